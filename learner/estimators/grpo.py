"""GRPO (DeepSeekMath; AdaSR eq. 2; docs/algorithms.md §5.1): every trained token of trajectory i
gets A_i = (R_i - mean_G R) / (std_G R + eps)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, group_normalize, scalar_rewards, uniform_assign
from loom.contracts.estimators import EPS, GrpoParams
from loom.contracts.wire import Group, TrajectoryReward


def grpo(rewards: Sequence[float], *, eps: float = EPS) -> list[float]:
    """GRPO (DeepSeekMath; AdaSR eq. 2): A_i = (R_i - mean_G R) / (std_G R + eps)."""
    return group_normalize(rewards, eps=eps)


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: GrpoParams) -> list[TokenAdvantages]:
    """A_i on every trained token of trajectory i."""
    r = scalar_rewards(group.trajectories, rewards, p.reward_key)
    return uniform_assign(group.trajectories, grpo(r, eps=p.eps))
