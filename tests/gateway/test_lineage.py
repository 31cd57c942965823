"""Every run trains its own lineage (docs/security.md "Runs' lineages"): runs of two keys started
together on one learner and one engine, through the product's run loop over the in-process stages on
the tiny model, each train step for step as the same run alone does, their trajectories in their own
namespaces, none a redelivery of another's step."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.models import RunRequest
from gateway.runs import RunLoop
from gateway.state import GatewayState
from loom.contracts.wire import Group

# what differs between two runs of the same data: wall-clock times
TIMES = ("train_seconds", "tokens_per_s", "trained_tokens_per_s")


def body(seed: int) -> RunRequest:
    return RunRequest.model_validate(
        {
            "dataset": {"builtin": "countdown", "size": 16, "seed": 3},
            # a length term: responses of a group differ in reward even when all are right or wrong
            "reward": {"components": [{"name": "accuracy"}, {"name": "length_kimi", "weight": 0.5}]},
            "sampling": {"n": 4, "temperature": 1.0, "max_tokens": 48, "seed": seed},
            "schedule": {"steps": 2, "batch_size": 2, "staleness": 0, "seed": seed},
        }
    )


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """One learner and one torch engine over one policy store, as one deployment's."""
    from learner.config import LearnerSettings
    from learner.train import Learner
    from loom.contracts.settings import Settings, get_settings
    from tests.gateway.test_step import in_process
    from zoo.registry import resolve_model_path

    monkeypatch.setenv("LOOM_POLICY_STORE", str(tmp_path / "policy"))
    get_settings.cache_clear()
    stages, engine = in_process(Settings(model="tiny", device="cpu"))
    stages.learner = Learner(LearnerSettings(model=resolve_model_path("tiny"), store=tmp_path / "policy"))
    try:
        yield stages
    finally:
        stages.close()
        engine.stop_scheduler()
        get_settings.cache_clear()


def run_all(stages: Any, state: GatewayState, data: Path, runs: list[str]) -> None:
    async def together() -> list[str]:
        return list(await asyncio.gather(*(RunLoop(r, state, stages, data).run() for r in runs)))

    assert asyncio.run(together()) == ["succeeded"] * len(runs)


def test_runs_of_two_keys_together_each_train_as_alone(stack: Any, tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "gw.sqlite")
    owners = {1: "alice", 2: "bob", 3: "alice"}  # a second run of alice's beside the other two

    def create(seed: int) -> str:
        return state.runs.create(owner=owners[seed], request=body(seed))[0]

    solo = {seed: create(seed) for seed in owners}
    for run in solo.values():  # each alone on the deployment
        run_all(stack, state, tmp_path, [run])
    together = {seed: create(seed) for seed in owners}
    run_all(stack, state, tmp_path, list(together.values()))

    trained = own = 0
    for seed in owners:
        alone, mine = state.runs.steps(solo[seed]), state.runs.steps(together[seed])
        assert len(mine) == len(alone) == 2
        for a, m in zip(alone, mine, strict=True):
            learner = sorted(k for k in a if k.startswith("learner/") and not k.endswith(TIMES))
            assert learner == sorted(k for k in m if k.startswith("learner/") and not k.endswith(TIMES))
            assert "learner/replayed" not in m
            trained += "learner/loss" in m
            for k in [*learner, "reward_mean", "policy_version", "gen_policy_version"]:
                assert m[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), (seed, m["step"], k)
        run = together[seed]
        gen = {m["step"]: m["gen_policy_version"] for m in mine}
        for sample in state.runs.samples(run):
            group = Group.model_validate(sample["group"])
            # the base model (version 0) until the run has trained, then the run's own versions
            v = gen[sample["step"]]
            at = (None, 0) if v == 0 else (run, v)
            assert {(t.policy_namespace, t.policy_version) for t in group.trajectories} == {at}
            own += v > 0
    assert trained >= 3 and own >= 2  # the runs learned, and generated with what they learned
