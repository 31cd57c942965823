"""TreeRL (AttnRL eq. 2-3; docs/algorithms.md §5.1-5.2): node advantages from the leaves' values, and
their tokens: tokens inside a tree node's [start, end) get that node's advantage; a node of another
trajectory applies where this trajectory's completion repeats the node's tokens at the same offsets
(a branch copies its prefix); uncovered trained tokens get the trajectory's leaf advantage. With
``process_weight`` > 0 a node's value mixes in its segment's PRM score (docs/algorithms.md §5.4).

The tree arithmetic lives in ``loom/treerl.py``: the rollouts client gives trainers the same numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, reward_of, step_scores, trained_mask
from loom.contracts.estimators import TREERL_REWARD_KEY, TreerlParams
from loom.contracts.wire import Group, TrajectoryReward, TreeNode
from loom.treerl import node_process_scores, token_advantages, tree_values


def treerl(nodes: Sequence[TreeNode], leaf_values: Mapping[str, float]) -> dict[str, float]:
    """TreeRL node advantages (AttnRL eq. 2-3):

        V(s) = mean correctness of the leaves under s                          (eq. 2)
        A(s) = (V(s) - V(root) + V(s) - V(parent(s))) / sqrt(|L(s)|)            (eq. 3)

    ``nodes`` are the group's tree nodes (``parent`` None = child of the prompt); ``leaf_values``
    maps a trajectory id to its correctness. A trajectory's leaf is its deepest node, so L(s) is the
    set of trajectories whose path passes through s. The root s_1 is the prompt: V(root) is the mean
    over all leaves, and it is the parent of every parentless node. Nodes with no leaf under them
    get advantage 0.
    """
    return tree_values(nodes, leaf_values).advantage


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: TreerlParams) -> list[TokenAdvantages]:
    """Each token gets the advantage of the deepest node on its trajectory's path that covers it."""
    if not group.tree:
        raise ValueError(f"group {group.id}: estimator treerl needs the group's tree")
    key = p.reward_key or TREERL_REWARD_KEY
    leaf_values = {}
    for t in group.trajectories:
        tr = reward_of(rewards, t)
        leaf_values[t.id] = float(tr.components.get(key, tr.total))
    process = None
    if p.process_weight > 0:  # the nodes' PRM scores mixed into their values (§5.4)
        scored = step_scores(group.id, group.trajectories, rewards, p.process_key)
        steps = {tid: [(s.start, s.end, s.score) for s in row] for tid, row in scored.items()}
        process = node_process_scores(group.tree, steps)
    tree = tree_values(group.tree, leaf_values, process, p.process_weight)  # also validates the tree
    by_traj = {t.id: t for t in group.trajectories}
    out = []
    for t in group.trajectories:
        m = trained_mask(t)
        out.append(TokenAdvantages(t, token_advantages(group.tree, tree, t, by_traj, m), m))
    return out
