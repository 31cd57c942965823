"""The learner's layout is decided once, when it is built (learner/distributed.py ``layout``): the
train step calls the same methods in one process as on N ranks; the batch goes through one step
top to bottom (its estimator params parsed once); the learner's modules import one another without
a loop (the helper ranks' entrypoint is learner/helper_rank.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from learner.config import LearnerSettings
from learner.distributed import OneProcess, Ranks, ShardedRanks, layout
from learner.train import Learner
from loom.contracts import estimators
from loom.contracts.wire import TrainBatch

LEARNER = Path(__file__).resolve().parents[2] / "learner"


def test_one_process_is_a_layout_whose_collectives_are_the_identity() -> None:
    one = layout(None, "fsdp")
    assert type(one) is OneProcess and type(layout(Ranks(0, 1), "fsdp")) is OneProcess
    assert (one.is_main, one.sharded, one.world) == (True, False, 1)
    assert one.share(["a", "b", "c"]) == ["a", "b", "c"]
    assert one.all_sum([1.0, 2.5]) == [1.0, 2.5] and one.all_max([3.0]) == [3.0]
    assert one.extra_passes(7) == 0 and one.broadcast({"x": 1}) == {"x": 1}


def test_n_ranks_are_replicated_or_sharded_as_the_settings_say() -> None:
    replicated = Ranks(1, 2)
    assert layout(replicated, "replicate") is replicated and not replicated.sharded
    sharded = layout(Ranks(1, 2), "fsdp")
    assert type(sharded) is ShardedRanks and sharded.sharded and (sharded.rank, sharded.world) == (1, 2)
    assert sharded.share(["a", "b", "c"]) == ["b"]  # every world-th sample from its rank


def test_a_one_process_learner_takes_its_step_through_the_one_process_layout(
    model_dir: Path, tmp_path: Path, batch_parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The estimator's params are parsed once, with the batch (the wire's discriminated union): the
    step reads the typed model and parses them no more (they were parsed again for the metrics)."""
    parsed: list[dict[str, object]] = []

    class Counted(estimators.GrpoParams):
        @classmethod
        def model_validate(cls, obj, **kw):  # type: ignore[no-untyped-def, override]
            parsed.append(dict(obj))
            return super().model_validate(obj, **kw)

    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    assert type(learner.ranks) is OneProcess
    groups, rewards = batch_parts()
    params = {"batch_size": 8, "target_groups": 2}  # AttnRL eq. 10: the metrics read them too
    batch = TrainBatch(step=0, groups=groups, rewards=rewards, estimator_params=params)
    assert isinstance(batch.estimator_params, estimators.GrpoParams)
    assert (batch.estimator_params.batch_size, batch.estimator_params.target_groups) == (8, 2)
    monkeypatch.setitem(estimators.ESTIMATOR_PARAMS, "grpo", Counted)
    result = learner.train_step(batch)
    assert result.policy_version == 1 and "next_batch_size" in result.metrics
    assert parsed == []


def _imports(path: Path) -> set[str]:
    """The learner modules ``path`` imports, at any depth, or names as a ``python -m`` module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    # only dotted names can be modules (a docstring is a string constant too, and may be too long a path)
    names = {m for m in found if m.replace(".", "").replace("_", "").isalnum() and len(m) < 200}
    return {m for m in names if (LEARNER.parent / (m.replace(".", "/") + ".py")).exists()}


def test_the_learner_modules_import_each_other_without_a_loop() -> None:
    modules = {f"learner.{p.stem}": p for p in LEARNER.glob("*.py")}
    graph = {name: _imports(path) - {name} for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, set()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    loops = sorted(name for name in graph if reaches(name, name, {name}))
    assert loops == [], loops
    assert "learner.train" not in graph["learner.distributed"]
