"""Cancelling a run stops it while its generation is in flight: nothing is trained or recorded after
the cancel, and a failure of the interrupted step does not turn the run into "failed". The stages are
in-process stand-ins (the loop's own logic is under test; test_e2e drives real workers)."""

from __future__ import annotations

import asyncio
import threading
import time

from gateway.models import RunRequest
from gateway.runs import RunLoop
from gateway.state import GatewayState
from loom.contracts.wire import (
    Group,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    StepResult,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
)


class BlockingStages:
    def __init__(self, fail_after_release: bool = False) -> None:
        self.release = threading.Event()
        self.generating = threading.Event()
        self.trained: list[int] = []
        self.fail_after_release = fail_after_release

    async def generate(self, key: str, request: RolloutRequest) -> Group:
        self.generating.set()
        deadline = time.monotonic() + 30
        while not self.release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.fail_after_release:
            raise RuntimeError("the interrupted step failed")
        trajs = [Trajectory(id=f"{key}.{i}", group_id=key, completion_ids=[1, 2]) for i in range(2)]
        return Group(id=key, trajectories=trajs)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        rewards = [
            TrajectoryReward(trajectory_id=t.id, total=float(i)) for i, t in enumerate(group.trajectories)
        ]
        return RewardResult(group_id=group.id, rewards=rewards)

    async def train(self, key: str, batch: TrainBatch) -> StepResult:
        self.trained.append(batch.step)
        return StepResult(step=batch.step, policy_version=batch.step + 1)


def _run(tmp_path, stages: BlockingStages) -> tuple[GatewayState, str, dict[str, str]]:  # type: ignore[no-untyped-def]
    state = GatewayState(tmp_path / "gw.sqlite")
    req = RunRequest.model_validate(
        {
            "dataset": {"builtin": "arith", "size": 8},
            "schedule": {"steps": 5, "batch_size": 2, "staleness": 0},
        }
    )
    run_id, _ = state.runs.create(owner="me", request=req)
    out: dict[str, str] = {}
    loop = RunLoop(run_id, state, stages, tmp_path)  # type: ignore[arg-type]
    thread = threading.Thread(target=lambda: out.setdefault("status", asyncio.run(loop.run())), daemon=True)
    thread.start()
    assert stages.generating.wait(30), "the first step never started generating"
    state.runs.update(run_id, status="cancelled")
    t0 = time.monotonic()
    while "status" not in out and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    out["waited"] = f"{time.monotonic() - t0:.2f}"
    stages.release.set()
    thread.join(30)
    return state, run_id, out


def test_a_cancel_during_generation_ends_the_run_without_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stages = BlockingStages()
    state, run_id, out = _run(tmp_path, stages)
    # returned while the generation was still blocked (it is released only after the loop returned)
    assert out["status"] == "cancelled", out
    time.sleep(0.5)
    row = state.runs.get(run_id)
    assert row is not None and row.status == "cancelled" and row.completed_steps == 0
    assert stages.trained == [] and state.runs.steps(run_id) == []


def test_a_cancelled_run_stays_cancelled_when_its_step_then_fails(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stages = BlockingStages(fail_after_release=True)
    state, run_id, out = _run(tmp_path, stages)
    assert out["status"] == "cancelled"
    row = state.runs.get(run_id)
    assert row is not None and row.status == "cancelled" and row.error is None


def test_a_run_cancelled_before_its_loop_starts_stays_cancelled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    state = GatewayState(tmp_path / "gw.sqlite")
    req = RunRequest.model_validate({"dataset": {"builtin": "arith", "size": 8}, "schedule": {"steps": 2}})
    run_id, _ = state.runs.create(owner="me", request=req)
    stages = BlockingStages()
    loop = RunLoop(run_id, state, stages, tmp_path)  # type: ignore[arg-type]
    state.runs.update(run_id, status="cancelled")
    assert asyncio.run(loop.run()) == "cancelled"
    row = state.runs.get(run_id)
    assert row is not None and row.status == "cancelled" and not stages.generating.is_set()
