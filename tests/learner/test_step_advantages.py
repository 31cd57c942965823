"""Step-level advantages from a PRM's step scores (docs/algorithms.md §5.4): step-level GRPO against its
equation computed by hand, TreeRL's node values mixed with the nodes' step scores, and the learner's
refusal of a batch without step scores, all through the learner's batch path (``assign_batch`` over a
parsed ``TrainBatch``)."""

from __future__ import annotations

import math
import statistics

import pytest
from pytest import approx

from learner.assign import assign_batch
from loom.contracts.wire import (
    Group,
    RewardResult,
    StepScore,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
    TreeNode,
)

EPS = 1e-6


def norm(xs: list[float]) -> list[float]:
    if len(xs) < 2 or statistics.pvariance(xs) <= 1e-12:
        return [0.0] * len(xs)
    m, s = statistics.fmean(xs), statistics.pstdev(xs)
    return [(x - m) / (s + EPS) for x in xs]


def steps(*spans: tuple[int, int, float]) -> dict[str, list[StepScore]]:
    return {"process": [StepScore(start=a, end=b, score=s) for a, b, s in spans]}


def batch(group: Group, rewards: list[TrajectoryReward], estimator: str, **params: object) -> TrainBatch:
    return TrainBatch(
        step=0,
        groups=[group],
        rewards=[RewardResult(group_id=group.id, rewards=rewards)],
        estimator=estimator,  # type: ignore[arg-type]
        estimator_params=params,
    )


def _group() -> tuple[Group, list[TrajectoryReward]]:
    trajs = [
        Trajectory(id="a", group_id="g", completion_ids=list(range(10, 16)), loss_mask=[1, 1, 1, 1, 1, 0]),
        Trajectory(id="b", group_id="g", completion_ids=list(range(20, 25))),
        Trajectory(id="c", group_id="g", completion_ids=list(range(30, 34))),
    ]
    rewards = [
        TrajectoryReward(trajectory_id="a", total=1.0, steps=steps((0, 2, 0.9), (2, 4, 0.8), (4, 6, 0.7))),
        TrajectoryReward(trajectory_id="b", total=0.0, steps=steps((0, 3, 0.2), (3, 5, 0.6))),
        TrajectoryReward(trajectory_id="c", total=1.0, steps=steps((1, 4, 0.5))),  # token 0 in no step
    ]
    return Group(id="g", trajectories=trajs), rewards


def test_step_grpo_matches_its_equation() -> None:
    """A_{i,t} = N_G(R)_i + c N_{G_k}(r_{.,k})_i, token t in step k; outside steps N_G(R)_i alone."""
    group, rewards = _group()
    c = 0.5
    out = {
        s.trajectory.id: s.adv
        for s in assign_batch(batch(group, rewards, "step_grpo", process_coef=c)).samples
    }
    oa, ob, oc = norm([1.0, 0.0, 1.0])
    d1 = norm([0.9, 0.2, 0.5])  # depth 1: a, b, c
    d2 = norm([0.8, 0.6])  # depth 2: a, b
    # depth 3: a alone -> 0
    assert out["a"] == approx([oa + c * d1[0]] * 2 + [oa + c * d2[0]] * 2 + [oa] + [0.0])  # last untrained
    assert out["b"] == approx([ob + c * d1[1]] * 3 + [ob + c * d2[1]] * 2)
    assert out["c"] == approx([oc] + [oc + c * d1[2]] * 3)
    assert d1[0] != 0 and d2[0] != 0  # the equation's terms are live in this example


def test_step_grpo_refuses_a_batch_without_step_scores() -> None:
    group, rewards = _group()
    bare = [r.model_copy(update={"steps": None}) for r in rewards]
    with pytest.raises(ValueError, match="no step scores of component 'process'"):
        assign_batch(batch(group, bare, "step_grpo"))
    chars = [
        r.model_copy(update={"steps": {"process": [StepScore(start=0, end=2, score=1, unit="char")]}})
        for r in rewards
    ]
    with pytest.raises(ValueError, match="character offsets"):
        assign_batch(batch(group, chars, "step_grpo"))
    # a trajectory whose PRM failed (a typed status) trains on its outcome term alone
    failed = [rewards[0], rewards[1].model_copy(update={"steps": None, "status": "prm_timeout"}), rewards[2]]
    out = {
        s.trajectory.id: s.adv
        for s in assign_batch(batch(group, failed, "step_grpo"), drop_zero=False).samples
    }
    assert out["b"] == approx([norm([1.0, 0.0, 1.0])[1]] * 5)


def test_the_learner_api_answers_422_for_a_batch_without_step_scores() -> None:
    from fastapi.testclient import TestClient

    from learner.api import app

    group, rewards = _group()
    bare = [r.model_copy(update={"steps": None}) for r in rewards]
    with TestClient(app) as c:
        r = c.post("/v1/train_step", json=batch(group, bare, "step_grpo").model_dump(mode="json"))
    assert r.status_code == 422 and "no step scores" in r.text


def _tree() -> tuple[Group, list[TrajectoryReward]]:
    base = list(range(10, 18))
    trajs = [
        Trajectory(id="t1", group_id="q", completion_ids=base),
        Trajectory(id="t2", group_id="q", completion_ids=[30, 31, 32]),
        Trajectory(id="t3", group_id="q", completion_ids=base[:4] + [40, 41, 42, 43, 44]),
    ]
    tree = [
        TreeNode(id="a1", parent=None, trajectory_id="t1", start=0, end=4),
        TreeNode(id="a2", parent="a1", trajectory_id="t1", start=4, end=8),
        TreeNode(id="b1", parent=None, trajectory_id="t2", start=0, end=3),
        TreeNode(id="a3", parent="a1", trajectory_id="t3", start=4, end=9),
    ]
    rewards = [
        TrajectoryReward(
            trajectory_id="t1", total=1, components={"accuracy": 1}, steps=steps((0, 4, 0.8), (4, 8, 0.6))
        ),
        TrajectoryReward(trajectory_id="t2", total=0, components={"accuracy": 0}, steps=steps((0, 3, 0.3))),
        TrajectoryReward(
            trajectory_id="t3", total=0, components={"accuracy": 0}, steps=steps((0, 4, 0.8), (4, 9, 0.1))
        ),
    ]
    return Group(id="q", mode="tree", trajectories=trajs, tree=tree), rewards


def test_treerl_with_process_scores_matches_its_equation() -> None:
    """V'(s) = (1 - w) V(s) + w P(s); A(s) = (V'(s) - V(root) + V'(s) - V'(parent)) / sqrt(|L(s)|)."""
    group, rewards = _tree()
    w = 0.25
    out = {
        s.trajectory.id: s.adv
        for s in assign_batch(batch(group, rewards, "treerl", process_weight=w)).samples
    }
    v_root = 1 / 3
    va1 = (1 - w) * 0.5 + w * 0.8  # leaves t1, t3
    va2, va3, vb1 = (1 - w) * 1 + w * 0.6, (1 - w) * 0 + w * 0.1, (1 - w) * 0 + w * 0.3
    a1 = (2 * va1 - 2 * v_root) / math.sqrt(2)
    a2, a3, b1 = (va2 - v_root) + (va2 - va1), (va3 - v_root) + (va3 - va1), 2 * (vb1 - v_root)
    assert out["t1"] == approx([a1] * 4 + [a2] * 4)
    assert out["t3"] == approx([a1] * 4 + [a3] * 5)
    assert out["t2"] == approx([b1] * 3)
    plain = {s.trajectory.id: s.adv for s in assign_batch(batch(group, rewards, "treerl")).samples}
    assert plain["t1"] != out["t1"]  # w = 0 is TreeRL's eq. 2-3 unchanged
    with pytest.raises(ValueError, match="no step scores"):
        bare = [r.model_copy(update={"steps": None}) for r in rewards]
        assign_batch(batch(group, bare, "treerl", process_weight=w))


def test_a_run_asking_for_step_scores_without_the_process_reward_is_a_422() -> None:
    from gateway.models import RunRequest
    from gateway.validate import check_submission
    from loom.contracts.settings import Settings

    def problem(estimator: str, params: dict[str, object], components: list[dict[str, object]]) -> object:
        body = {"dataset": {"builtin": "arith"}, "estimator": estimator, "estimator_params": params}
        req = RunRequest.model_validate({**body, "reward": {"components": components}})
        return check_submission([], req, Settings(), None).problem

    bare = [{"name": "accuracy"}]
    stepped = [*bare, {"name": "process", "weight": 0.0, "params": {"prm": "p"}}]
    refused = problem("step_grpo", {}, bare)
    assert isinstance(refused, dict) and refused["detail"][0]["loc"] == ["body", "reward", "components"]
    assert problem("treerl", {"process_weight": 0.5}, bare) is not None
    assert problem("step_grpo", {}, stepped) is None
    assert problem("treerl", {}, bare) is None  # no process weight: TreeRL as ever
