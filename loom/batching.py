"""Adaptive batch size (AttnRL §3.3 eq. 10; docs/algorithms.md §5.3) and DAPO's group filter. Pure.

One rule for both callers: the gateway, which sizes the next step's batch, and the learner, which
reports the size its valid groups call for (the ``next_batch_size`` metric). The group filter
(:func:`differs`) is the gateway run loop's ``filter_groups`` and the RL benches' ``--filter-groups``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loom.contracts.wire import RewardResult

TOTAL = "reward"  # the name under which :func:`differs` reads the summed reward


def differs(result: RewardResult, component: str) -> bool:
    """Whether the group's responses differ in reward ``component`` (``"reward"``: the summed total).

    DAPO's dynamic sampling (verl's ``algorithm.filter_groups``) keeps only such groups: a group whose
    accuracy is the same for every response carries no relative signal on it, and GRPO's normalisation
    would scale up whatever else is left of its summed reward (length, format) into full-size
    advantages. A missing component reads 0, so a group that lacks it everywhere is uniform.
    """
    if component == TOTAL:
        values = {r.total for r in result.rewards}
    else:
        values = {r.components.get(component, 0.0) for r in result.rewards}
    return len(values) > 1


def next_batch_size(
    batch_size: int,
    target: int,
    n_valid: int,
    *,
    lam: float = 0.9,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """B_{m+1} = round(λ B_m + (1 − λ) · B' / B''_m · B_m), clamped to [minimum, maximum].

    ``batch_size`` = B_m (prompts sampled at step m), ``target`` = B' (the wanted number of groups
    with a non-zero advantage), ``n_valid`` = B''_m (the number step m obtained). A step that
    obtained none is taken as having obtained one (the largest growth the rule allows).
    """
    if batch_size < 1 or target < 1:
        raise ValueError("batch_size and target must be >= 1")
    obtained = max(n_valid, 1)
    value = lam * batch_size + (1.0 - lam) * target / obtained * batch_size
    nxt = max(minimum, round(value))
    if maximum is not None:
        nxt = min(maximum, nxt)
    return int(nxt)
