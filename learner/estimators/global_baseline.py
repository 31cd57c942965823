"""Reinforce-Ada's global baseline (docs/algorithms.md §4): every trained token of trajectory i gets
A_i = r_i - mean(pool), the mean over ALL responses sampled for the prompt across rounds, not over
the kept n; optionally / (std(pool) + eps)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, scalar_rewards, uniform_assign
from loom.contracts.estimators import EPS, GlobalBaselineParams
from loom.contracts.wire import Group, PoolStats, TrajectoryReward


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
    """Reinforce-Ada global statistics (docs/algorithms.md §4): A_i = r_i - mean(pool), the mean
    over ALL responses sampled for the prompt across rounds, not over the kept n; optionally
    / (std(pool) + eps).

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


def assign(
    group: Group, rewards: Mapping[str, TrajectoryReward], p: GlobalBaselineParams
) -> list[TokenAdvantages]:
    """A_i on every trained token of trajectory i."""
    if group.pool is not None and p.reward_key not in (None, "total"):
        # the pool's sums are of the total reward (what adaptive sampling ranks by): mixing them
        # with another component's r_i would centre on the wrong mean
        raise ValueError(
            f"group {group.id}: global_baseline's pool statistics are of the total reward, "
            f"so estimator_params.reward_key must be 'total' (got {p.reward_key!r})"
        )
    r = scalar_rewards(group.trajectories, rewards, p.reward_key)
    return uniform_assign(group.trajectories, global_baseline(r, group.pool, std=p.std, eps=p.eps))
