"""Adaptive batch size (AttnRL §3.3 eq. 10; ALGORITHMS.md 5.3). Pure.

The learner package exposes the same rule for its own use; services never import each other, so the
gateway, which schedules the batches, carries this copy of one line of arithmetic.
"""

from __future__ import annotations


def next_batch_size(
    batch: int, target_groups: int, obtained_groups: int, lam: float = 0.9, lo: int = 1, hi: int = 4096
) -> int:
    """B_{m+1} = round(λ B_m + (1 − λ) · B' / B''_m · B_m), clamped to [lo, hi].

    B' is the wanted number of groups with non-zero advantage, B''_m the number step m obtained; a
    step that obtained none is treated as having obtained one (the largest growth the rule allows).
    """
    obtained = max(obtained_groups, 1)
    value = lam * batch + (1.0 - lam) * target_groups / obtained * batch
    return max(lo, min(hi, round(value)))
