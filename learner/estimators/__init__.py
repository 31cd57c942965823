"""Advantage estimators, one file each: the estimator's equation (a pure function over floats, its
docstring citing docs/algorithms.md §5.1 and the paper's equation) and its token assignment (how a
group's advantages become per-token advantages, ``assign``). :data:`ESTIMATORS` is the one table.

Notation: ``N_G(x) = (x - mean_G(x)) / (std_G(x) + eps)`` is the group normalisation
(:func:`group_normalize`); a component with zero variance (or a group of one) gives zero advantage.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from learner.estimators import apr as _apr
from learner.estimators import dr_grpo as _dr_grpo
from learner.estimators import global_baseline as _global_baseline
from learner.estimators import grpo as _grpo
from learner.estimators import hrpo as _hrpo
from learner.estimators import rea as _rea
from learner.estimators import treerl as _treerl
from learner.estimators.apr import apr
from learner.estimators.common import TokenAdvantages, group_normalize, kind_mask, trained_mask
from learner.estimators.dr_grpo import dr_grpo
from learner.estimators.global_baseline import global_baseline, pool_mean_std
from learner.estimators.grpo import grpo
from learner.estimators.hrpo import HrpoAdvantage, hrpo
from learner.estimators.rea import rea
from learner.estimators.treerl import treerl
from loom.contracts.estimators import EstimatorParams, HrpoNames, estimator_params
from loom.contracts.wire import Group, TrajectoryReward

Assign = Callable[[Group, Mapping[str, TrajectoryReward], Any], list[TokenAdvantages]]

# estimator -> its token assignment (its params model: loom.contracts.estimators.ESTIMATOR_PARAMS)
ESTIMATORS: dict[str, Assign] = {
    "grpo": _grpo.assign,
    "dr_grpo": _dr_grpo.assign,
    "global_baseline": _global_baseline.assign,
    "hrpo": _hrpo.assign,
    "treerl": _treerl.assign,
    "rea": _rea.assign,
    "apr": _apr.assign,
}


def assign_group(
    group: Group,
    rewards: Mapping[str, TrajectoryReward],
    estimator: str,
    params: Mapping[str, Any] | EstimatorParams,
) -> list[TokenAdvantages]:
    """Per-token advantages of one group under ``estimator`` (``params``: its estimator_params)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}")
    if not isinstance(params, EstimatorParams):
        params = estimator_params(estimator, params)
    return ESTIMATORS[estimator](group, rewards, params)


__all__ = [
    "ESTIMATORS",
    "HrpoAdvantage",
    "HrpoNames",
    "TokenAdvantages",
    "apr",
    "assign_group",
    "dr_grpo",
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
