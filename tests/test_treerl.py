"""loom/treerl.py is TreeRL's one implementation (issue 36): the learner's ``treerl`` estimator and the
rollouts client give every token the same advantage, on trees with copied prefixes, loss masks,
observations, a node of no trajectory and a missing accuracy component."""

from __future__ import annotations

import math
import random

import pytest

from learner.estimators.treerl import assign
from loom.clients.rollouts import tree_advantages
from loom.contracts.estimators import TreerlParams
from loom.contracts.wire import Group, Segment, Trajectory, TrajectoryReward, TreeNode
from loom.treerl import token_advantages, tree_values


def _random_group(seed: int) -> tuple[Group, dict[str, TrajectoryReward]]:
    rng = random.Random(seed)
    prefix = [rng.randint(0, 5) for _ in range(4)]
    trajs: list[Trajectory] = []
    nodes: list[TreeNode] = []
    for i in range(rng.randint(1, 6)):
        n = rng.randint(3, 12)
        fresh = [rng.randint(0, 5) for _ in range(n)]
        completion = (prefix + fresh)[:n] if rng.random() < 0.6 else fresh  # a branch repeats the prefix
        trajs.append(
            Trajectory(
                id=f"t{i}",
                group_id="g",
                completion_ids=completion,
                loss_mask=[rng.randint(0, 1) for _ in range(n)] if rng.random() < 0.4 else None,
                segments=[Segment(kind="observation", start=1, end=2)] if rng.random() < 0.2 else [],
                policy_version=0,
            )
        )
        parent, start = None, 0
        for j in range(rng.randint(1, 3)):
            if parent is None and nodes and rng.random() < 0.5:
                parent = rng.choice(nodes).id
            end = min(n + rng.randint(0, 2), start + rng.randint(1, 5))  # may run past the completion
            nodes.append(TreeNode(id=f"n{i}.{j}", parent=parent, trajectory_id=f"t{i}", start=start, end=end))
            parent, start = f"n{i}.{j}", end
    if rng.random() < 0.2:
        nodes.append(TreeNode(id="orphan", trajectory_id="gone", start=0, end=1))
    rewards = {
        t.id: TrajectoryReward(
            trajectory_id=t.id,
            total=rng.random(),
            components={"accuracy": float(rng.randint(0, 1))} if rng.random() < 0.7 else {},
        )
        for t in trajs
    }
    return Group(id="g", trajectories=trajs, tree=nodes), rewards


@pytest.mark.parametrize("seed", range(40))
def test_the_client_and_the_learner_give_every_token_the_same_advantage(seed: int) -> None:
    group, rewards = _random_group(seed)
    learner = {ta.trajectory.id: ta.adv for ta in assign(group, rewards, TreerlParams())}
    client, values = tree_advantages(group, rewards)
    assert client == learner
    assert set(values) == {n.id for n in group.tree or []}


def test_node_values_and_advantages_by_hand() -> None:
    """root -> a (t0, t1 pass through) -> b (t1's leaf); t0's leaf is a, t2's leaf is c (a root)."""
    nodes = [
        TreeNode(id="a", trajectory_id="t0", start=0, end=2),
        TreeNode(id="b", parent="a", trajectory_id="t1", start=2, end=4),
        TreeNode(id="c", trajectory_id="t2", start=0, end=3),
    ]
    tree = tree_values(nodes, {"t0": 1.0, "t1": 0.0, "t2": 1.0})
    v_root = 2 / 3
    assert tree.leaf_of == {"t0": "a", "t1": "b", "t2": "c"}
    assert tree.value == pytest.approx({"a": 0.5, "b": 0.0, "c": 1.0})
    assert tree.advantage["a"] == pytest.approx(2 * (0.5 - v_root) / math.sqrt(2))
    assert tree.advantage["b"] == pytest.approx((0.0 - v_root) + (0.0 - 0.5))
    assert tree.advantage["c"] == pytest.approx(2 * (1.0 - v_root))
    # t1 repeats a's tokens at a's offsets: its first two tokens take a's advantage, the rest b's
    t0 = Trajectory(id="t0", group_id="g", completion_ids=[7, 8], policy_version=0)
    t1 = Trajectory(id="t1", group_id="g", completion_ids=[7, 8, 9, 9], policy_version=0)
    adv = token_advantages(nodes, tree, t1, {"t0": t0, "t1": t1}, [1, 1, 1, 0])
    assert adv == [tree.advantage["a"], tree.advantage["a"], tree.advantage["b"], 0.0]


@pytest.mark.parametrize(
    ("nodes", "words"),
    [
        ([TreeNode(id="a", parent="b", trajectory_id="t", start=0, end=1),
          TreeNode(id="b", parent="a", trajectory_id="t", start=1, end=2)], "cycle"),
        ([TreeNode(id="a", parent="nowhere", trajectory_id="t", start=0, end=1)], "unknown parent"),
    ],
)  # fmt: skip
def test_a_tree_that_is_not_one_is_refused_by_both(nodes: list[TreeNode], words: str) -> None:
    t = Trajectory(id="t", group_id="g", completion_ids=[1, 2], policy_version=0)
    group = Group(id="g", trajectories=[t], tree=nodes)
    rewards = {"t": TrajectoryReward(trajectory_id="t", total=1.0)}
    with pytest.raises(ValueError, match=words):
        assign(group, rewards, TreerlParams())
    with pytest.raises(ValueError, match=f"group g: the tree is not a tree: .*{words}"):
        tree_advantages(group, rewards)


def _with_steps(group: Group, rewards: dict[str, TrajectoryReward], seed: int) -> dict[str, TrajectoryReward]:
    """Each trajectory's PRM step scores: one per node of its own that lies inside its completion."""
    from loom.contracts.wire import StepScore

    rng = random.Random(seed)
    n = {t.id: len(t.completion_ids) for t in group.trajectories}
    out = {}
    for tid, r in rewards.items():
        spans = [
            (x.start, x.end) for x in group.tree or [] if x.trajectory_id == tid and x.start < x.end <= n[tid]
        ]
        steps = [StepScore(start=a, end=b, score=rng.random()) for a, b in spans]
        out[tid] = r.model_copy(update={"steps": {"process": steps}})
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_client_mixes_in_process_scores_as_the_learner_does(seed: int) -> None:
    from loom.clients.rollouts import RolloutGroup

    group, plain = _random_group(seed)
    rewards = _with_steps(group, plain, seed)
    params = TreerlParams(process_weight=0.4)
    learner = {ta.trajectory.id: ta.adv for ta in assign(group, rewards, params)}
    client, _ = tree_advantages(group, rewards, params=params)
    assert client == learner
    scored = {"index": 0, "group": group, "rewards": {"group_id": "g", "rewards": list(rewards.values())}}
    from_event = RolloutGroup.from_event(scored, params)
    assert {s.id: s.advantages for s in from_event.samples} == learner
    without = {ta.trajectory.id: ta.adv for ta in assign(group, rewards, TreerlParams())}
    assert {s.id: s.advantages for s in RolloutGroup.from_event(scored).samples} == without


def test_the_client_refuses_process_weight_without_step_scores_like_the_learner() -> None:
    group, rewards = _random_group(3)
    params = TreerlParams(process_weight=0.5)
    with pytest.raises(ValueError, match="no step scores"):
        assign(group, rewards, params)
    with pytest.raises(ValueError, match="no step scores"):
        tree_advantages(group, rewards, params=params)
