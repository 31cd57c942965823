"""Adaptive batch size (AttnRL §3.3 eq. 10; docs/algorithms.md §5.3). Pure.

One rule for both callers: the gateway, which sizes the next step's batch, and the learner, which
reports the size its valid groups call for (the ``next_batch_size`` metric).
"""

from __future__ import annotations


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
