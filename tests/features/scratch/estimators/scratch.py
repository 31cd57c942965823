"""A scratch estimator, the whole of it (tests/features/test_one_registration.py registers it): the
reward above a fixed baseline as every trained token's advantage, and a loss of its own (REINFORCE on the
tokens, no clip), so the learner's estimator hook for the loss shape is exercised too."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor

from learner.estimators.common import TokenAdvantages, scalar_rewards, uniform_assign
from learner.losses import LossParts, LossTerms
from loom.contracts.wire import Group, LossSpec, TrajectoryReward
from tests.features.scratch.contracts import ScratchParams

CALLS = {"assign": 0, "loss": 0}


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: ScratchParams) -> list[TokenAdvantages]:
    CALLS["assign"] += 1
    r = scalar_rewards(group.trajectories, rewards, p.reward_key)
    return uniform_assign(group.trajectories, [p.scale * (x - p.baseline) for x in r])


def loss(
    logp: Tensor,
    old: Tensor,
    adv: Tensor,
    mask: Tensor,
    rows: Sequence[TokenAdvantages],
    spec: LossSpec,
    terms: LossTerms,
) -> LossParts:
    CALLS["loss"] += 1
    objective = (adv * logp * mask).sum() / mask.sum().clamp(min=1.0)
    zero = objective.detach() * 0
    return LossParts(-objective, zero, zero, zero)
