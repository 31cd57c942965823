"""The run loop's ``filter_groups`` (DAPO's dynamic sampling, docs/algorithms.md §5.3) with in-process
stand-in stages: the loop's own logic is under test (which groups reach the learner, what the adaptive
batch size counts); test_filter_groups_real.py runs the same option on the real services."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

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


class Stages:
    """Group k of a step: even k, accuracy 0/1 across its responses; odd k, accuracy 0 everywhere but
    a length term that differs (a summed-reward signal without an accuracy signal)."""

    def __init__(self, accuracy_signal: bool = True) -> None:
        self.batches: list[TrainBatch] = []
        self.accuracy_signal = accuracy_signal  # False: every group is of the odd kind

    async def generate(self, key: str, request: RolloutRequest) -> Group:
        trajs = [Trajectory(id=f"{key}.{i}", group_id=key, completion_ids=[1] * (i + 1)) for i in range(4)]
        return Group(id=key, trajectories=trajs)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        k = int(group.id.rsplit(".p", 1)[1])  # the group's prompt index in its batch
        rewards = []
        for i, t in enumerate(group.trajectories):
            acc = float(i % 2) if k % 2 == 0 and self.accuracy_signal else 0.0
            length = -0.1 * i
            rewards.append(
                TrajectoryReward(
                    trajectory_id=t.id,
                    total=acc + length,
                    components={"accuracy": acc, "length_kimi": length},
                )
            )
        return RewardResult(group_id=group.id, rewards=rewards)

    async def train(self, key: str, batch: TrainBatch) -> StepResult:
        self.batches.append(batch)
        return StepResult(step=batch.step, policy_version=batch.step + 1)


def _run(tmp_path: Path, stages: Stages | None = None, **extra: Any) -> tuple[Stages, list[dict[str, Any]]]:
    state = GatewayState(tmp_path / "gw.sqlite")
    body: dict[str, Any] = {
        "dataset": {"builtin": "arith", "size": 16},
        "reward": {"components": [{"name": "accuracy"}, {"name": "length_kimi", "weight": 1.0}]},
        "schedule": {
            "steps": 2,
            "batch_size": 4,
            "staleness": 0,
            "adaptive_batch": True,
            "target_groups": 4,
            "batch_lambda": 0.0,
        },
        **extra,
    }
    run_id, _ = state.runs.create(owner="me", request=RunRequest.model_validate(body))
    stages = stages or Stages()
    assert asyncio.run(RunLoop(run_id, state, stages, tmp_path).run()) == "succeeded"  # type: ignore[arg-type]
    return stages, state.runs.steps(run_id)


def test_only_the_groups_whose_accuracy_differs_are_trained(tmp_path: Path) -> None:
    stages, metrics = _run(tmp_path, filter_groups="accuracy")
    assert [len(b.groups) for b in stages.batches] == [2, 4]  # batches of 4 then 8 prompts: the even ones
    for batch in stages.batches:
        for result in batch.rewards:  # every trained group has an accuracy signal
            assert len({r.components["accuracy"] for r in result.rewards}) == 2
    assert [m["trained_groups"] for m in metrics] == [2.0, 4.0]
    # B'' counts the trained groups: 2 of the wanted 4, so the next batch doubles (lambda 0), then holds
    assert [m["next_batch_size"] for m in metrics] == [8, 8]


def test_without_the_filter_every_group_with_a_summed_signal_is_trained(tmp_path: Path) -> None:
    stages, metrics = _run(tmp_path)
    assert [len(b.groups) for b in stages.batches] == [4, 4]
    assert [m["trained_groups"] for m in metrics] == [4.0, 4.0]
    assert [m["next_batch_size"] for m in metrics] == [4, 4]


def test_a_step_whose_groups_are_all_filtered_out_trains_nothing(tmp_path: Path) -> None:
    stages, metrics = _run(tmp_path, Stages(accuracy_signal=False), filter_groups="accuracy")
    assert stages.batches == []  # nothing reached the learner
    assert [m["trained_groups"] for m in metrics] == [0.0, 0.0]
    assert all(m["skipped_update"] == 1.0 and m["policy_version"] == 0 for m in metrics)
    # the same groups filtered on the summed reward (which the length term makes differ) are trained
    stages, metrics = _run(tmp_path / "total", Stages(accuracy_signal=False), filter_groups="reward")
    assert [len(b.groups) for b in stages.batches] == [4, 4]


def test_further_batches_are_drawn_until_the_batch_is_full(tmp_path: Path) -> None:
    """filter_max_batches (DAPO's re-sampling): 2 of each batch's 4 groups pass, so each step draws a
    second batch of other rows and trains 4 groups; keys name the batch, so a resumed step re-walks it."""
    stages, metrics = _run(tmp_path, filter_groups="accuracy", filter_max_batches=3)
    assert [len(b.groups) for b in stages.batches] == [4, 4]
    assert [m["gen_batches"] for m in metrics] == [2.0, 2.0]
    assert [m["trained_groups"] for m in metrics] == [4.0, 4.0]
    first = [g.id for g in stages.batches[0].groups]
    assert sum(".s0.b1." in gid for gid in first) == 2 and sum(".s0.p" in gid for gid in first) == 2
    assert [m["next_batch_size"] for m in metrics] == [4, 4]  # B'' = 4 trained groups of the wanted 4


def test_a_step_stops_drawing_at_filter_max_batches(tmp_path: Path) -> None:
    stages, metrics = _run(
        tmp_path, Stages(accuracy_signal=False), filter_groups="accuracy", filter_max_batches=3
    )
    assert stages.batches == []
    assert metrics[0]["gen_batches"] == 3.0 and metrics[0]["adaptive_prompts"] == 12.0  # 3 batches of 4 rows
    assert metrics[0]["adaptive_samples_per_prompt"] == 4.0


def test_further_batches_draw_other_rows() -> None:
    from gateway.datasets import step_indices

    assert step_indices(100, 8, 0, 3) == step_indices(100, 8, 0, 3, 0)  # the first batch as before
    assert step_indices(100, 8, 0, 3, 1) != step_indices(100, 8, 0, 3)
    assert step_indices(100, 8, 0, 3, 1) == step_indices(100, 8, 0, 3, 1)  # deterministic for a resume
