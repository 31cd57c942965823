"""The learner matches rewards to trajectories by (group, trajectory) (issue 24, item 4): trajectory ids
are numbered per group, so the same id in two groups must never share a reward; an id that repeats
inside a group, or a reward given twice, is a 422 before any queue."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from learner.api import build_app
from learner.assign import assign_batch
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, RewardResult, TrainBatch, Trajectory, TrajectoryReward
from loom.queue import make_celery


def _group(gid: str, tids: list[str]) -> Group:
    return Group(
        id=gid,
        trajectories=[
            Trajectory(id=t, group_id=gid, prompt_ids=[1, 2], completion_ids=[3, 4, 5], logprobs=[-1.0] * 3)
            for t in tids
        ],
    )


def _rewards(gid: str, totals: dict[str, float]) -> RewardResult:
    return RewardResult(
        group_id=gid,
        rewards=[
            TrajectoryReward(trajectory_id=t, total=v, components={"accuracy": v}) for t, v in totals.items()
        ],
    )


def _two_groups() -> tuple[list[Group], list[RewardResult]]:
    groups = [_group("A", ["t0", "t1"]), _group("B", ["t0", "t1"])]
    rewards = [_rewards("A", {"t0": 1.0, "t1": 0.0}), _rewards("B", {"t0": 0.0, "t1": 1.0})]
    return groups, rewards


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rea"])
def test_the_same_trajectory_id_in_two_groups_keeps_its_own_groups_reward(estimator: str) -> None:
    groups, rewards = _two_groups()
    out = assign_batch(TrainBatch(step=0, groups=groups, rewards=rewards, estimator=estimator))
    adv = {(s.group_id, s.trajectory.id): s.adv[0] for s in out.samples}
    assert adv[("A", "t0")] > 0 and adv[("A", "t1")] < 0  # A/t0 was the right one in A
    assert adv[("B", "t0")] < 0 and adv[("B", "t1")] > 0
    if estimator == "grpo":
        assert adv[("A", "t0")] == pytest.approx(1.0, abs=1e-3)


def test_rewards_listed_in_the_other_order_give_the_same_advantages() -> None:
    groups, rewards = _two_groups()
    a = assign_batch(TrainBatch(step=0, groups=groups, rewards=rewards))
    b = assign_batch(TrainBatch(step=0, groups=groups, rewards=rewards[::-1]))
    assert [s.adv for s in a.samples] == [s.adv for s in b.samples]


def test_a_reward_filed_under_another_group_is_missing_not_borrowed() -> None:
    groups, _ = _two_groups()
    rewards = [_rewards("A", {"t0": 1.0, "t1": 0.0}), _rewards("C", {"t0": 0.0, "t1": 1.0})]
    with pytest.raises(ValueError, match="trajectory t0 of group B has no reward"):
        assign_batch(TrainBatch(step=0, groups=groups, rewards=rewards))


def test_duplicate_ids_inside_a_group_and_duplicate_rewards_are_refused() -> None:
    groups, rewards = _two_groups()
    with pytest.raises(ValidationError, match="trajectory id 't0' appears more than once in group 'A'"):
        TrainBatch(step=0, groups=[_group("A", ["t0", "t0"]), groups[1]], rewards=rewards)
    with pytest.raises(ValidationError, match="group id 'A' appears more than once"):
        TrainBatch(step=0, groups=[groups[0], groups[0]], rewards=rewards)
    twice = RewardResult(group_id="A", rewards=[*rewards[0].rewards, rewards[0].rewards[0]])
    with pytest.raises(ValidationError, match="trajectory 't0' of group 'A' has more than one reward"):
        TrainBatch(step=0, groups=groups, rewards=[twice, rewards[1]])


def _post(body: dict[str, Any], tmp_path: Any) -> Any:
    settings = Settings(data_dir=tmp_path / "d")
    app = build_app(settings, make_celery("learner", settings))
    with TestClient(app, raise_server_exceptions=False) as client:
        return client.post("/v1/train_step", json=body, params={"timeout": 5})


def test_duplicate_trajectory_ids_in_a_group_are_a_422_at_the_learner_api(tmp_path: Any) -> None:
    groups, rewards = _two_groups()
    body = TrainBatch(step=0, groups=groups, rewards=rewards).model_dump(mode="json")
    body["groups"][0]["trajectories"][1]["id"] = "t0"
    r = _post(body, tmp_path)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "groups"] and "'t0' appears more than once in group 'A'" in err["msg"]
