"""How the modes are laid out (issue 36 item 5): each mode module is its algorithm alone, one dispatch
entry feeds them all, and tree mode's scorer transport and grading live in ``rollout_svc.modes.scorers``.
The engines are real (Loom's tiny checkpoint in the torch engine, the simulated engine)."""

from __future__ import annotations

import ast
import asyncio
import importlib
from pathlib import Path
from typing import Any

import pytest

from loom.contracts.modes import PlainParams, TreeParams
from loom.contracts.settings import Settings
from loom.contracts.wire import RolloutRequest, SamplingParams
from rollout_svc.engines.base import UnsupportedCapability
from rollout_svc.engines.simulated import SimulatedEngine
from rollout_svc.modes import MODES, PROVIDERS, Inputs, mode_needs, mode_runner, run
from rollout_svc.modes.scorers import operator_scorer, resolve_scorer

MODES_DIR = Path(__file__).resolve().parents[2] / "rollout_svc" / "modes"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_each_mode_module_is_its_algorithm_without_a_dispatch_shim() -> None:
    for name in MODES:
        module = importlib.import_module(MODES[name][1])
        assert mode_runner(name) is getattr(module, name)
        assert not hasattr(module, "run"), f"{name}: the dispatch is rollout_svc.modes.run alone"


def test_tree_mode_holds_no_scorer_transport_nor_deployment_settings() -> None:
    tree_src = MODES_DIR / "tree.py"
    assert not {"httpx", "loom.contracts.settings", "loom.exact"} & _imports(tree_src)
    defined = {n.name for n in ast.walk(ast.parse(tree_src.read_text())) if isinstance(n, ast.FunctionDef)}
    assert not {"http_scorer", "resolve_scorer", "exact_reward_fn"} & defined


def test_the_rule_that_a_tree_needs_fci_is_written_once() -> None:
    texts = [p.read_text() for p in MODES_DIR.glob("*.py")]
    assert sum(t.count("fci_running_mean is not None") for t in texts) == 1


async def _scores(
    ids: list[int], steps: list[tuple[int, int]], delta: int, zero_from: int | None
) -> list[float]:
    return [1.0] * len(steps)


asked: list[tuple[str | None, int]] = []


def _operator(policy: tuple[str | None, int]) -> Any:
    asked.append(policy)  # the operator's scorer is built for the policy the engine serves
    return _scores


def test_the_engines_own_scorer_comes_before_the_operators(tiny_engine: Any) -> None:
    assert resolve_scorer(tiny_engine, _operator) == tiny_engine.score_attention
    assert resolve_scorer(tiny_engine) == tiny_engine.score_attention


def test_an_engine_without_scores_uses_the_operators_scorer_or_refuses() -> None:
    engine = SimulatedEngine(ms_per_token=0.0)
    engine.policy_version, engine.policy_namespace = 3, "run-a"
    assert resolve_scorer(engine, _operator) is _scores and asked[-1] == ("run-a", 3)
    with pytest.raises(UnsupportedCapability, match="LOOM_ATTENTION_URL"):
        resolve_scorer(engine)


def test_the_operators_scorer_exists_only_where_the_operator_set_its_url() -> None:
    cfg = TreeParams()
    assert operator_scorer(Settings(attention_url=""), cfg) is None
    assert callable(operator_scorer(Settings(attention_url="http://127.0.0.1:9"), cfg))
    request = RolloutRequest(prompt="x", mode="tree", task="arithmetic", label="3")
    assert mode_needs("tree") == ("tokenizer", "params", "reward_fn", "scorer")
    inputs = Inputs(request, lambda: None, cfg, Settings(attention_url=""))
    assert PROVIDERS["scorer"](inputs) is None and callable(PROVIDERS["reward_fn"](inputs))


def test_the_dispatch_of_plain_mode_never_loads_the_tokenizer() -> None:
    def no_tokenizer() -> Any:
        raise AssertionError("plain mode loaded the tokenizer")

    engine = SimulatedEngine(ms_per_token=0.0)
    request = RolloutRequest(prompt_ids=[1, 2, 3], sampling=SamplingParams(n=2, max_tokens=4, seed=1))
    group = asyncio.run(run(request, [1, 2, 3], "g", engine, no_tokenizer, PlainParams(), Settings()))
    assert [len(t.completion_ids) for t in group.trajectories] == [4, 4]
