"""The three HRPO terms written separately (AdaSR eq. 5), the reference the fused
``learner.losses.hrpo_loss`` is checked against (its value and its gradient)."""

from __future__ import annotations

import torch
from torch import Tensor

from learner.losses import clipped_surrogate


def hrpo_terms(
    logp: Tensor,
    old_logp: Tensor,
    adv_stream: Tensor,
    adv_deep: Tensor,
    adv_global: Tensor,
    mask: Tensor,
    stream_mask: Tensor,
    *,
    lam: float = 0.05,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> tuple[Tensor, Tensor, Tensor]:
    """The three terms of -J_HRPO written separately as in eq. 5 (streaming-local, deep-local, global),
    each a batch mean over trajectories; an empty phase's term is 0 for that trajectory. Used to check
    that the fused :func:`hrpo_loss` equals their sum (and so does its gradient)."""
    b = logp.shape[0]
    terms = []
    stream = stream_mask * mask
    deep = mask - stream
    for adv, phase, coef in ((adv_stream, stream, lam), (adv_deep, deep, lam), (adv_global, mask, 1.0)):
        c, _ = clipped_surrogate(logp, old_logp, adv, eps_low, eps_high)
        total = torch.zeros((), dtype=logp.dtype, device=logp.device)
        for i in range(b):
            n = phase[i].sum()
            if n.item() > 0:
                total = total + coef * (c[i] * phase[i]).sum() / n
        terms.append(-total / b)
    return terms[0], terms[1], terms[2]
