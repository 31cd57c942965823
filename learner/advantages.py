"""Advantage estimators: one function per estimator, the equation cited (ALGORITHMS.md 5.1).

Every function takes the plain numbers of ONE group (rewards, components, a tree) and returns plain
numbers; ``learner/assign.py`` turns them into per-token advantages from the trajectories' segments.

Notation: ``N_G(x) = (x - mean_G(x)) / (std_G(x) + eps)`` is the group normalisation
(:func:`group_normalize`); a component with zero variance (or a group of one) gives zero advantage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.schemas import PoolStats, TreeNode

EPS = 1e-6


def group_normalize(x: Sequence[float], *, eps: float = EPS, scale: bool = True) -> list[float]:
    """N_G(x) = (x - mean) / (std + eps) with the population std; zero variance -> all zeros."""
    n = len(x)
    if n == 0:
        return []
    mean = sum(x) / n
    centred = [v - mean for v in x]
    var = sum(c * c for c in centred) / n
    if var <= 1e-12:  # zero variance (includes a single sample): no relative signal
        return [0.0] * n
    if not scale:
        return centred
    std = math.sqrt(var)
    return [c / (std + eps) for c in centred]


def grpo(rewards: Sequence[float], *, eps: float = EPS) -> list[float]:
    """GRPO (DeepSeekMath; AdaSR eq. 2): A_i = (R_i - mean_G R) / (std_G R + eps)."""
    return group_normalize(rewards, eps=eps)


def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """Dr. GRPO: A_i = R_i - mean_G R (no std division, which biases towards easy/hard prompts)."""
    return group_normalize(rewards, scale=False)


def pool_mean_std(pool: PoolStats) -> tuple[float, float]:
    """Mean and population std of every reward sampled for a prompt across rounds (Reinforce-Ada)."""
    if pool.n_sampled == 0:
        return 0.0, 0.0
    mean = pool.reward_sum / pool.n_sampled
    var = max(pool.reward_sq_sum / pool.n_sampled - mean * mean, 0.0)
    return mean, math.sqrt(var)


def global_baseline(
    rewards: Sequence[float], pool: PoolStats | None, *, std: bool = False, eps: float = EPS
) -> list[float]:
    """Reinforce-Ada global statistics (ALGORITHMS.md 4): A_i = r_i - mean(pool), the mean over ALL
    responses sampled for the prompt across rounds, not over the kept n; optionally / (std(pool) + eps).

    Without pool statistics the kept group itself is the pool.
    """
    if pool is None or pool.n_sampled == 0:
        n = len(rewards)
        pool = PoolStats(
            n_sampled=n, reward_sum=float(sum(rewards)), reward_sq_sum=float(sum(r * r for r in rewards))
        )
    mean, sd = pool_mean_std(pool)
    adv = [r - mean for r in rewards]
    if std:
        if sd <= 1e-12:
            return [0.0] * len(rewards)
        adv = [a / (sd + eps) for a in adv]
    return adv


@dataclass(frozen=True)
class HrpoNames:
    """Reward component names HRPO reads (reward_svc's names by default)."""

    accuracy: str = "accuracy"
    format_stream: str = "format_stream"
    format_deep: str = "format_deep"
    length_stream: str = "length_stream"
    length_deep: str = "length_deep"
    efficiency: str = "efficiency"


@dataclass(frozen=True)
class HrpoAdvantage:
    """A^s, A^d, A^g of one trajectory (``adv_stream``, ``adv_deep``, ``adv_global``)."""

    adv_stream: float
    adv_deep: float
    adv_global: float


def _masked_normalize(x: Sequence[float], valid: Sequence[bool], eps: float) -> list[float]:
    """N_G over the valid members only; invalid members get 0 (format masking, AdaSR appendix C)."""
    idx = [i for i, ok in enumerate(valid) if ok]
    normed = group_normalize([x[i] for i in idx], eps=eps)
    out = [0.0] * len(x)
    for i, v in zip(idx, normed, strict=True):
        out[i] = v
    return out


def hrpo(
    components: Sequence[Mapping[str, float]],
    *,
    beta: float = 0.05,
    w_acc: float = 1.0,
    w_fmt: float = 2.0,
    mask_length_by_format: bool = True,
    names: HrpoNames = HrpoNames(),
    eps: float = EPS,
) -> list[HrpoAdvantage]:
    """HRPO component-wise advantages (AdaSR eq. 8), beta applied AFTER normalisation (appendix C):

        A^s = w_fmt N_G(R_fmt^s) + beta N_G(R^{Ls})
        A^d = w_fmt N_G(R_fmt^d) + beta N_G(R^{Ld})
        A^g = w_acc N_G(R_acc)   + beta N_G(R_eff)

    ``w_acc``/``w_fmt`` are AdaSR Table 6's accuracy/format coefficients (1 and 2), multiplying the
    normalised component advantages. With ``mask_length_by_format`` the length penalties are
    normalised over the format-valid members only and invalid members get 0 for that term
    (length is not gated by accuracy; format validity is handled at advantage time, appendix C).
    A missing component counts as 0 for every member (so it contributes nothing).
    """

    def col(name: str) -> list[float]:
        return [float(c.get(name, 0.0)) for c in components]

    fmt_s, fmt_d = col(names.format_stream), col(names.format_deep)
    len_s, len_d = col(names.length_stream), col(names.length_deep)
    if mask_length_by_format:
        n_len_s = _masked_normalize(len_s, [f > 0.5 for f in fmt_s], eps)
        n_len_d = _masked_normalize(len_d, [f > 0.5 for f in fmt_d], eps)
    else:
        n_len_s, n_len_d = group_normalize(len_s, eps=eps), group_normalize(len_d, eps=eps)
    n_fmt_s, n_fmt_d = group_normalize(fmt_s, eps=eps), group_normalize(fmt_d, eps=eps)
    n_acc = group_normalize(col(names.accuracy), eps=eps)
    n_eff = group_normalize(col(names.efficiency), eps=eps)
    return [
        HrpoAdvantage(
            adv_stream=w_fmt * n_fmt_s[i] + beta * n_len_s[i],
            adv_deep=w_fmt * n_fmt_d[i] + beta * n_len_d[i],
            adv_global=w_acc * n_acc[i] + beta * n_eff[i],
        )
        for i in range(len(components))
    ]


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
    by_id = {n.id: n for n in nodes}
    depth: dict[str, int] = {}

    def depth_of(nid: str) -> int:
        if nid not in depth:
            seen: list[str] = []
            cur: str | None = nid
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
            depth[nid] = d
        return depth[nid]

    for n in nodes:  # every node's chain is checked first: a cycle or an unknown parent is a ValueError
        depth_of(n.id)
    leaf_of: dict[str, str] = {}  # trajectory -> its deepest node
    for n in nodes:
        if n.trajectory_id in leaf_values:
            cur = leaf_of.get(n.trajectory_id)
            if cur is None or depth_of(n.id) > depth_of(cur):
                leaf_of[n.trajectory_id] = n.id
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


def rea(rewards: Sequence[float], *, eps: float = EPS) -> list[float]:
    """REA-RL (§4.2): GRPO over the originals and the kept revisions together; a revision competing
    with its original is equivalent to a partial penalty on the truncated tokens."""
    return grpo(rewards, eps=eps)


def apr(rewards: Sequence[float], n_calls: Sequence[int], *, eps: float = EPS) -> list[tuple[float, float]]:
    """APR (§3): each rollout's GRPO advantage A_r = N_G(R_r) is given to EVERY call of its spawn
    forest, and each call's loss is weighted 1 / (number of calls in the forest).

    Returns ``(advantage, per-call weight)`` for each rollout.
    """
    adv = grpo(rewards, eps=eps)
    return [(a, 1.0 / max(1, c)) for a, c in zip(adv, n_calls, strict=True)]
