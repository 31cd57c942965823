"""REA-RL (§4.2; docs/algorithms.md §5.1): GRPO over the originals and the kept revisions together;
a revision competing with its original is equivalent to a partial penalty on the truncated tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from learner.estimators.common import TokenAdvantages, scalar_rewards, uniform_assign
from learner.estimators.grpo import grpo
from loom.contracts.estimators import EPS, ReaParams
from loom.contracts.wire import Group, TrajectoryReward


def rea(rewards: Sequence[float], *, eps: float = EPS) -> list[float]:
    """REA-RL (§4.2): GRPO over the originals and the kept revisions together; a revision competing
    with its original is equivalent to a partial penalty on the truncated tokens."""
    return grpo(rewards, eps=eps)


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: ReaParams) -> list[TokenAdvantages]:
    """A_i on every trained token of trajectory i (original or revision alike)."""
    r = scalar_rewards(group.trajectories, rewards, p.reward_key)
    return uniform_assign(group.trajectories, rea(r, eps=p.eps))
