"""TreeRL's node values and advantages over a group's tree, and their tokens (AttnRL eq. 2-3;
docs/algorithms.md §5.1-5.2). Pure functions on the wire contracts, shared by the learner's
``treerl`` estimator (``learner/estimators/treerl.py``) and the rollouts client
(``loom/clients/rollouts.py``), which must give a trainer the very advantages the learner trains on.

A trajectory's leaf is its deepest node; L(s) is the set of trajectories whose path passes through s.
The root is the prompt: V(root) is the mean over all leaves, and it is the parent of every parentless
node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.contracts.wire import Trajectory, TreeNode


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


@dataclass
class TreeValues:
    """A tree's leaves (trajectory id -> leaf node id), V(s) and A(s) (node id -> value)."""

    leaf_of: dict[str, str]
    value: dict[str, float]
    advantage: dict[str, float]


def tree_values(
    nodes: Sequence[TreeNode],
    leaf_values: Mapping[str, float],
    process: Mapping[str, float] | None = None,
    weight: float = 0.0,
) -> TreeValues:
    """V(s) = mean correctness of the leaves under s                          (eq. 2)
    A(s) = (V(s) - V(root) + V(s) - V(parent(s))) / sqrt(|L(s)|)              (eq. 3)

    ``leaf_values`` maps a trajectory id to its correctness; nodes with no leaf under them get
    V = A = 0. With ``process`` (node id -> its segment's PRM score, :func:`node_process_scores`) and
    ``weight`` w, a scored node's value is (1 - w) V(s) + w P(s) (docs/algorithms.md §5.4); V(root)
    stays the leaves' mean."""
    by_id = {n.id: n for n in nodes}
    leaf_of = leaves(nodes, node_depths(nodes), leaf_values)
    under: dict[str, list[float]] = {n.id: [] for n in nodes}
    for tid, leaf in leaf_of.items():
        node: str | None = leaf
        while node is not None:
            under[node].append(float(leaf_values[tid]))
            node = by_id[node].parent
    all_leaves = [float(leaf_values[t]) for t in leaf_of]
    v_root = sum(all_leaves) / len(all_leaves) if all_leaves else 0.0
    value = {nid: (sum(v) / len(v) if v else 0.0) for nid, v in under.items()}
    for nid, score in (process or {}).items():
        if under.get(nid):
            value[nid] = (1.0 - weight) * value[nid] + weight * score
    adv: dict[str, float] = {}
    for n in nodes:
        k = len(under[n.id])
        if k == 0:
            adv[n.id] = 0.0
            continue
        v_parent = v_root if n.parent is None else value[n.parent]
        adv[n.id] = ((value[n.id] - v_root) + (value[n.id] - v_parent)) / math.sqrt(k)
    return TreeValues(leaf_of, value, adv)


def node_process_scores(
    nodes: Sequence[TreeNode], steps: Mapping[str, Sequence[tuple[int, int, float]]]
) -> dict[str, float]:
    """Each node's PRM score: the step of its own trajectory (``steps``: trajectory id -> its steps'
    (start, end, score), the process reward scored with steps='segments') that spans exactly the
    node's tokens; a node without one is not in the result (its value stays the leaves')."""
    out: dict[str, float] = {}
    for n in nodes:
        for a, b, score in steps.get(n.trajectory_id, ()):
            if (a, b) == (n.start, n.end):
                out[n.id] = float(score)
                break
    return out


def token_advantages(
    nodes: Sequence[TreeNode],
    tree: TreeValues,
    t: Trajectory,
    trajectories: Mapping[str, Trajectory],
    mask: list[int],
) -> list[float]:
    """Each trained token (``mask``) of ``t`` gets the advantage of the deepest node on its leaf's
    path that covers it: tokens inside a node's [start, end); a node of another trajectory applies
    where ``t``'s completion repeats the node's tokens at the same offsets (a branch copies its
    prefix). The other trained tokens get the leaf's advantage; untrained tokens get 0."""
    by_id = {n.id: n for n in nodes}
    adv = [0.0] * len(mask)
    covered = [False] * len(mask)
    leaf = tree.leaf_of.get(t.id)
    cur = leaf
    while cur is not None:  # the leaf's path, deepest first
        node = by_id[cur]
        cur = node.parent
        owner = trajectories.get(node.trajectory_id)
        if node.end > len(mask) or owner is None:
            continue
        span = slice(node.start, node.end)
        if owner is not t and owner.completion_ids[span] != t.completion_ids[span]:
            continue  # the prefix lives in this trajectory's prompt, not its completion
        for j in range(node.start, node.end):
            if not covered[j]:
                adv[j], covered[j] = tree.advantage[node.id], True
    fill = tree.advantage[leaf] if leaf is not None else 0.0
    return [(a if c else fill) if m else 0.0 for a, c, m in zip(adv, covered, mask, strict=True)]
