"""Advantage estimators, one file each: the estimator's equation (a pure function over floats, its
docstring citing docs/algorithms.md §5.1 and the paper's equation), its token assignment (how a
group's advantages become per-token advantages, ``assign``) and, when its objective has a shape of
its own, its ``loss`` (HRPO's three terms); without one the learner uses the clipped policy loss.

The registration of an estimator is its line in the contract's table
(``loom.contracts.estimators.ESTIMATOR_PARAMS``: name -> params model, which the gateway validates
with): :func:`estimator` finds its module ``learner/estimators/<name>.py`` by that name. A new
estimator is that file plus that line (docs/architecture.md, "One registration per feature").

Notation: ``N_G(x) = (x - mean_G(x)) / (std_G(x) + eps)`` is the group normalisation
(:func:`group_normalize`); a component with zero variance (or a group of one) gives zero advantage.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from learner.estimators.apr import apr
from learner.estimators.common import TokenAdvantages, group_normalize, kind_mask, trained_mask
from learner.estimators.dr_grpo import dr_grpo
from learner.estimators.global_baseline import global_baseline, pool_mean_std
from learner.estimators.grpo import grpo
from learner.estimators.hrpo import HrpoAdvantage, hrpo
from learner.estimators.rea import rea
from learner.estimators.treerl import treerl
from learner.losses import LossParts, LossTerms
from loom.contracts.estimators import ESTIMATOR_PARAMS, EstimatorParams, HrpoNames, estimator_params
from loom.contracts.wire import Group, LossSpec, TrajectoryReward

Assign = Callable[[Group, Mapping[str, TrajectoryReward], Any], list[TokenAdvantages]]
# (logp, old logp, A per token, mask, the assigned rows, the batch's loss spec, the shared terms)
Loss = Callable[[Tensor, Tensor, Tensor, Tensor, Sequence[TokenAdvantages], LossSpec, LossTerms], LossParts]


@dataclass(frozen=True)
class Estimator:
    """One estimator as the learner runs it: its params model (the contract's), its token
    assignment, and its own loss (None: the clipped policy loss, ``learner.losses.policy_loss``)."""

    name: str
    params: type[EstimatorParams]
    assign: Assign
    loss: Loss | None = None


def estimator(name: str) -> Estimator:
    """The estimator registered as ``name`` in ``ESTIMATOR_PARAMS``: its module's ``assign`` and
    optional ``loss`` (the module is imported on first use)."""
    if name not in ESTIMATOR_PARAMS:
        raise ValueError(f"unknown estimator {name!r}; available: {sorted(ESTIMATOR_PARAMS)}")
    module = importlib.import_module(f"learner.estimators.{name}")
    return Estimator(name, ESTIMATOR_PARAMS[name], module.assign, getattr(module, "loss", None))


def assign_group(
    group: Group,
    rewards: Mapping[str, TrajectoryReward],
    name: str,
    params: Mapping[str, Any] | EstimatorParams,
) -> list[TokenAdvantages]:
    """Per-token advantages of one group under estimator ``name`` (``params``: its estimator_params)."""
    est = estimator(name)
    if not isinstance(params, EstimatorParams):
        params = estimator_params(name, params)
    return est.assign(group, rewards, params)


__all__ = [
    "Estimator",
    "HrpoAdvantage",
    "HrpoNames",
    "TokenAdvantages",
    "apr",
    "assign_group",
    "dr_grpo",
    "estimator",
    "global_baseline",
    "group_normalize",
    "grpo",
    "hrpo",
    "kind_mask",
    "pool_mean_std",
    "rea",
    "trained_mask",
    "treerl",
]
