"""bench/tree.py's mixed-branch measure (issue 29): a branch point counts as mixed when the parent path's
reward and its continuations' rewards are not all equal, once per (parent path, branch point)."""

from __future__ import annotations

from loom.contracts.wire import Trajectory
from tests.bench.test_rl_benches import bench


def _t(tid: str, parent: str | None = None, point: int | None = None) -> Trajectory:
    meta = {} if point is None else {"branch_point": point}
    return Trajectory(id=tid, group_id="g", parent_id=parent, meta=meta)


def test_a_branch_point_is_mixed_when_its_outcomes_differ():
    differ = bench("tree").branch_outcomes_differ
    trajectories = [
        _t("a"),  # a root, right
        _t("a.1", "a", 5),  # two continuations at token 5 of a: one wrong -> mixed
        _t("a.2", "a", 5),
        _t("a.3", "a", 9),  # two at token 9, both right like a -> not mixed
        _t("a.4", "a", 9),
        _t("b"),  # a root without branches: no branch point
        _t("a.1.1", "a.1", 3),  # a later round on a.1 (wrong): a right continuation -> mixed
    ]
    reward = {"a": True, "a.1": False, "a.2": True, "a.3": True, "a.4": True, "b": False, "a.1.1": True}
    assert sorted(differ(trajectories, reward)) == [False, True, True]
    assert differ(trajectories, {k: False for k in reward}) == [False, False, False]
