"""TreeRL (AttnRL eq. 2-3; docs/algorithms.md §5.1-5.2): node advantages from the leaves' values, and
their tokens: tokens inside a tree node's [start, end) get that node's advantage; a node of another
trajectory applies where this trajectory's completion repeats the node's tokens at the same offsets
(a branch copies its prefix); uncovered trained tokens get the trajectory's leaf advantage."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, reward_of, trained_mask
from loom.contracts.estimators import TREERL_REWARD_KEY, TreerlParams
from loom.contracts.wire import Group, TrajectoryReward, TreeNode


def node_depths(nodes: Sequence[TreeNode]) -> dict[str, int]:
    """Depth of every node (a parentless node has depth 1); a cycle or an unknown parent is a
    ValueError, raised before anything else reads the tree."""
    by_id = {n.id: n for n in nodes}
    depth: dict[str, int] = {}
    for n in nodes:
        if n.id in depth:
            continue
        seen: list[str] = []
        cur: str | None = n.id
        d = 0
        while cur is not None:
            if cur in seen:
                raise ValueError(f"tree has a cycle through node {cur}")
            seen.append(cur)
            parent = by_id[cur].parent
            if parent is not None and parent not in by_id:
                raise ValueError(f"node {cur} names unknown parent {parent}")
            cur = parent
            d += 1
        depth[n.id] = d
    return depth


def leaves(
    nodes: Sequence[TreeNode], depth: Mapping[str, int], trajectories: Mapping[str, object]
) -> dict[str, str]:
    """Each trajectory's leaf: its deepest node (the first in ``nodes`` order among equals)."""
    leaf_of: dict[str, str] = {}
    for n in nodes:
        if n.trajectory_id in trajectories:
            cur = leaf_of.get(n.trajectory_id)
            if cur is None or depth[n.id] > depth[cur]:
                leaf_of[n.trajectory_id] = n.id
    return leaf_of


def _node_advantages(
    nodes: Sequence[TreeNode], leaf_of: Mapping[str, str], leaf_values: Mapping[str, float]
) -> dict[str, float]:
    by_id = {n.id: n for n in nodes}
    under: dict[str, list[float]] = {n.id: [] for n in nodes}
    for tid, leaf in leaf_of.items():
        node: str | None = leaf
        while node is not None:
            under[node].append(float(leaf_values[tid]))
            node = by_id[node].parent
    all_leaves = [float(leaf_values[t]) for t in leaf_of]
    v_root = sum(all_leaves) / len(all_leaves) if all_leaves else 0.0
    value = {nid: (sum(v) / len(v) if v else 0.0) for nid, v in under.items()}
    adv: dict[str, float] = {}
    for n in nodes:
        k = len(under[n.id])
        if k == 0:
            adv[n.id] = 0.0
            continue
        v_parent = v_root if n.parent is None else value[n.parent]
        adv[n.id] = ((value[n.id] - v_root) + (value[n.id] - v_parent)) / math.sqrt(k)
    return adv


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
    return _node_advantages(nodes, leaves(nodes, node_depths(nodes), leaf_values), leaf_values)


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: TreerlParams) -> list[TokenAdvantages]:
    """Each token gets the advantage of the deepest node on its trajectory's path that covers it."""
    if not group.tree:
        raise ValueError(f"group {group.id}: estimator treerl needs the group's tree")
    tree = group.tree
    key = p.reward_key or TREERL_REWARD_KEY
    leaf_values = {}
    for t in group.trajectories:
        tr = reward_of(rewards, t)
        leaf_values[t.id] = float(tr.components.get(key, tr.total))
    depth = node_depths(tree)  # once per group: it also validates the tree
    leaf_of = leaves(tree, depth, leaf_values)
    node_adv = _node_advantages(tree, leaf_of, leaf_values)
    by_traj = {t.id: t for t in group.trajectories}
    by_id = {n.id: n for n in tree}
    out = []
    for t in group.trajectories:
        m = trained_mask(t)
        adv = [0.0] * len(m)
        covered = [0] * len(m)
        leaf = leaf_of.get(t.id)
        cur = leaf
        while cur is not None:  # the leaf's path, deepest first
            node = by_id[cur]
            cur = node.parent
            owner = by_traj.get(node.trajectory_id)
            if node.end > len(m) or owner is None:
                continue
            if (
                owner is not t
                and owner.completion_ids[node.start : node.end] != t.completion_ids[node.start : node.end]
            ):
                continue  # the prefix lives in this trajectory's prompt, not its completion
            for j in range(node.start, node.end):
                if not covered[j]:
                    adv[j] = node_adv[node.id]
                    covered[j] = 1
        fill = node_adv[leaf] if leaf is not None else 0.0
        adv = [(a if c else fill) if mm else 0.0 for a, c, mm in zip(adv, covered, m, strict=True)]
        out.append(TokenAdvantages(t, adv, m))
    return out
