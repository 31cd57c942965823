"""Dr. GRPO (docs/algorithms.md §5.1): every trained token of trajectory i gets A_i = R_i - mean_G R
(no std division, which biases towards easy/hard prompts)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, group_normalize, scalar_rewards, uniform_assign
from loom.contracts.estimators import DrGrpoParams
from loom.contracts.wire import Group, TrajectoryReward


def dr_grpo(rewards: Sequence[float]) -> list[float]:
    """Dr. GRPO: A_i = R_i - mean_G R (no std division, which biases towards easy/hard prompts)."""
    return group_normalize(rewards, scale=False)


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: DrGrpoParams) -> list[TokenAdvantages]:
    """A_i on every trained token of trajectory i."""
    r = scalar_rewards(group.trajectories, rewards, p.reward_key)
    return uniform_assign(group.trajectories, dr_grpo(r))
