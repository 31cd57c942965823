"""gateway/web/views.py: what the run page makes of a group's tree, spawn links and revisions. The
groups are built with the wire models (loom/contracts/wire.py) in the shapes rollout_svc/modes/tree.py,
spawn.py and reflect_svc/revise.py write; the browser test covers groups from the real services."""

from __future__ import annotations

import math
from typing import Any

from gateway.web.views import forest_view, group_view, tree_view
from loom.contracts.wire import (
    Group,
    RewardResult,
    Segment,
    ThreadLink,
    Trajectory,
    TrajectoryReward,
    TreeNode,
)


def payload(group: Group, totals: dict[str, float]) -> dict[str, Any]:
    rewards = RewardResult(
        group_id=group.id,
        rewards=[
            TrajectoryReward(trajectory_id=k, total=v, components={"accuracy": v}) for k, v in totals.items()
        ],
    )
    return {"index": 0, "group": group.model_dump(mode="json"), "rewards": rewards.model_dump(mode="json")}


def node_segments(*nodes: tuple[str, int, int]) -> list[Segment]:
    return [
        Segment(kind="tree_node", start=a, end=b, index=d, meta={"node": n})
        for d, (n, a, b) in enumerate(nodes)
    ]


def test_tree_nodes_carry_their_value_branch_point_and_entropy_score() -> None:
    # one initial path "a" (6 tokens) branched at token 2 into "b"; node a:0 = [0, 2), a:1 = [2, 6)
    a = Trajectory(
        id="a",
        group_id="g",
        completion_ids=[1] * 6,
        logprobs=[-0.1, -0.2, -2.5, -0.1, -0.1, -0.1],
        segments=node_segments(("a:0", 0, 2), ("a:1", 2, 6)),
    )
    b = Trajectory(
        id="b",
        group_id="g",
        completion_ids=[1] * 5,
        parent_id="a",
        meta={"branch_point": 2, "branch_index": 0, "strategy": "entropy"},
        segments=node_segments(("a:0", 0, 2), ("b:0", 2, 5)),
    )
    tree = [
        TreeNode(id="a:0", trajectory_id="a", start=0, end=2),
        TreeNode(id="a:1", parent="a:0", trajectory_id="a", start=2, end=6),
        TreeNode(id="b:0", parent="a:0", trajectory_id="b", start=2, end=5),
    ]
    group = Group(id="g", mode="tree", trajectories=[a, b], tree=tree)
    (root,) = tree_view(payload(group, {"a": 1.0, "b": 0.0}))
    assert root.id == "a:0" and root.value == 0.5 and root.n_leaves == 2 and root.branch_point is None
    kids = {n.id: n for n in root.children}
    assert kids["a:1"].value == 1.0 and kids["a:1"].branch_point is None
    assert kids["b:0"].value == 0.0 and kids["b:0"].branch_point == 2 and kids["b:0"].strategy == "entropy"
    assert kids["b:0"].score == "-log p 2.500"  # the parent's sampled token at the branch point

    # attention: the FCI tree mode recorded for the step the branch starts, not the path's highest
    b.meta = {"branch_point": 2, "branch_index": 0, "strategy": "attention", "branch_fci": 0.25}
    attention = Group(id="g", mode="tree", trajectories=[a, b], tree=tree, meta={"fci": {"a": [0.25, 0.9]}})
    (root,) = tree_view(payload(attention, {"a": 1.0, "b": 0.0}))
    assert {n.id: n for n in root.children}["b:0"].score == "FCI 0.250"


def test_spawn_calls_nest_by_their_thread_links() -> None:
    calls = [
        Trajectory(id="r", group_id="g", completion_ids=[1] * 4, meta={"depth": 0, "status": "ok"}),
        Trajectory(id="r.c0", group_id="g", completion_ids=[1] * 2, parent_id="r", meta={"depth": 1}),
        Trajectory(id="r.c1", group_id="g", completion_ids=[1] * 2, parent_id="r", meta={"depth": 1}),
        Trajectory(id="s", group_id="g", completion_ids=[1] * 3, meta={"depth": 0}),
    ]
    links = [ThreadLink(parent="r", child="r.c0", message="try 3"), ThreadLink(parent="r", child="r.c1")]
    group = Group(id="g", mode="spawn", trajectories=calls, threads=links)
    roots = forest_view(payload(group, {"r": 1.0}))
    assert [c.id for c in roots] == ["r", "s"]
    assert [c.id for c in roots[0].children] == ["r.c0", "r.c1"] and roots[0].children[0].message == "try 3"
    assert roots[0].total == 1.0 and roots[1].total is None and roots[1].children == []


def test_revisions_and_segments_are_marked_where_they_are() -> None:
    original = Trajectory(
        id="t",
        group_id="g",
        completion_ids=[1] * 10,
        segments=[Segment(kind="stream", start=0, end=4), Segment(kind="answer", start=8, end=10)],
    )
    revision = Trajectory(
        id="t.rev",
        group_id="g",
        completion_ids=[1] * 8,
        parent_id="t",
        segments=[Segment(kind="revision", start=5, end=8)],
        meta={"revision_of": "t"},
    )
    view = group_view(payload(Group(id="g", trajectories=[original, revision]), {"t": 0.0, "t.rev": 1.0}))
    plain, revised = view.trajectories
    assert not plain.truncated and revised.truncated and revised.revision_of == "t"
    assert [(b.kind, b.left, b.width) for b in plain.bars] == [("stream", 0.0, 40.0), ("answer", 80.0, 20.0)]
    (bar,) = revised.bars
    assert bar.kind == "revision" and math.isclose(bar.left, 62.5) and math.isclose(bar.width, 37.5)
    assert view.tree == [] and view.forest == []
