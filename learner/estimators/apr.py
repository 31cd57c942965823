"""APR (§3; docs/algorithms.md §5.1): each rollout's GRPO advantage A_r = N_G(R_r) is given to EVERY
call of its spawn forest, and each call's loss is weighted 1 / (number of calls in the forest)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, scalar_rewards, trained_mask, uniform
from learner.estimators.grpo import grpo
from loom.contracts.estimators import EPS, AprParams
from loom.contracts.wire import Group, Trajectory, TrajectoryReward


def apr(rewards: Sequence[float], n_calls: Sequence[int], *, eps: float = EPS) -> list[tuple[float, float]]:
    """APR (§3): each rollout's GRPO advantage A_r = N_G(R_r) is given to EVERY call of its spawn
    forest, and each call's loss is weighted 1 / (number of calls in the forest).

    Returns ``(advantage, per-call weight)`` for each rollout.
    """
    adv = grpo(rewards, eps=eps)
    return [(a, 1.0 / max(1, c)) for a, c in zip(adv, n_calls, strict=True)]


def _forest_root(t: Trajectory, parent_of: Mapping[str, str | None]) -> str:
    cur, seen = t.id, set()
    while parent_of.get(cur) is not None and cur not in seen:
        seen.add(cur)
        cur = parent_of[cur]  # type: ignore[assignment]
    return cur


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: AprParams) -> list[TokenAdvantages]:
    """The rollouts are the forest roots (a trajectory's parent, or a thread link's); every call
    gets its root's advantage and weight."""
    trajs = group.trajectories
    parent_of: dict[str, str | None] = {t.id: t.parent_id for t in trajs}
    for link in group.threads or []:
        parent_of[link.child] = link.parent
    root_of = {t.id: _forest_root(t, parent_of) for t in trajs}
    roots = [t for t in trajs if root_of[t.id] == t.id]
    calls = {r.id: sum(1 for t in trajs if root_of[t.id] == r.id) for r in roots}
    adv_w = apr(scalar_rewards(roots, rewards, p.reward_key), [calls[r.id] for r in roots], eps=p.eps)
    by_root = {r.id: aw for r, aw in zip(roots, adv_w, strict=True)}
    out = []
    for t in trajs:
        a, w = by_root[root_of[t.id]]
        m = trained_mask(t)
        out.append(TokenAdvantages(t, uniform(a, m), m, weight=w))
    return out
