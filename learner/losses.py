"""Policy losses (docs/algorithms.md §5.2). Pure torch on padded [B, T] completion tensors.

Every function returns a LOSS (to minimise) = minus the objective of the paper. Masks are 0/1 float
tensors of trained tokens (observation tokens are 0 in every mask, so they enter no sum).
``denom`` arguments let a caller that splits a batch into micro-batches normalise by the WHOLE
batch's counts, so accumulated gradients equal the full-batch gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import torch
from torch import Tensor

from loom.contracts.wire import Aggregation

LOG_RATIO_CLAMP = 20.0  # exp(20) = 4.9e8: far beyond any clip range, finite in float32


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, adv: Tensor, eps_low: float = 0.2, eps_high: float = 0.28
) -> tuple[Tensor, Tensor]:
    """C(r, A) = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp - old_logp)
    (PPO; clip-higher from DAPO). Returns (C per token, 1.0 where the clipped branch is active).

    The log-ratio is clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before ``exp`` (as verl does): a
    token whose behaviour log-prob is far below the policy's (a masked observation token carrying
    any number, an external trainer's stale log-probs) would otherwise overflow to inf, and inf * 0
    in the mask, or in the backward pass of ``minimum``, makes the whole loss and gradient NaN."""
    ratio = torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    surrogate = torch.minimum(unclipped, clipped)
    return surrogate, (clipped < unclipped).to(logp.dtype)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi || pi_ref) per token (Schulman): exp(ref - logp) - (ref - logp) - 1 >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: Aggregation,
    *,
    seq_weight: Tensor | None = None,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
) -> Tensor:
    """Reduce per-token values [B, T] to a scalar.

    - ``token_mean``: sum over all trained tokens / number of trained tokens in the batch (DAPO,
      Reinforce-Ada);
    - ``seq_mean_token_mean``: mean over sequences of each sequence's token mean (GRPO paper);
    - ``seq_mean_token_sum``: mean over sequences of each sequence's token sum.
    ``seq_weight`` [B] multiplies each sequence's contribution (APR: 1 / calls in the forest).
    """
    v = values * mask
    if seq_weight is not None:
        v = v * seq_weight[:, None]
    if mode == "token_mean":
        denom = n_tokens if n_tokens is not None else float(mask.sum().item())
        return v.sum() / max(denom, 1.0)
    per_seq = v.sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(dim=1).clamp(min=1.0)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"unknown aggregation {mode!r}")
    denom = n_seqs if n_seqs is not None else float(values.shape[0])
    return per_seq.sum() / max(denom, 1.0)


@dataclass
class LossParts:
    loss: Tensor
    clip_frac: Tensor  # fraction of trained tokens where a clipped branch is active
    kl: Tensor  # mean k3 KL over trained tokens (0 when no reference)
    entropy: Tensor  # mean entropy over trained tokens (0 when not computed)


def _mean(x: Tensor | None, mask: Tensor) -> Tensor:
    if x is None:
        return torch.zeros((), device=mask.device)
    return (x.detach() * mask).sum() / mask.sum().clamp(min=1.0)


class LossTerms(TypedDict, total=False):
    """The keyword terms both losses take (defaults in brackets): the clip range ``eps_low`` (0.2) and
    ``eps_high`` (0.28, DAPO's clip-higher); the k3 KL to a reference, ``ref_logp`` [B, T] and
    ``kl_coef`` (0); the entropy bonus, ``entropy`` [B, T] and ``entropy_coef`` (0); ``seq_weight`` [B]
    (APR: 1 / calls in the forest); ``n_seqs``, the whole batch's sequence count (a micro-batch's own
    when None); ``is_weight`` [B, T], the TIS weight (learner/mismatch.py; a constant, 1 when None)."""

    eps_low: float
    eps_high: float
    ref_logp: Tensor | None
    kl_coef: float
    entropy: Tensor | None
    entropy_coef: float
    seq_weight: Tensor | None
    n_seqs: float | None
    is_weight: Tensor | None


def _surrogate(logp: Tensor, old_logp: Tensor, adv: Tensor, terms: LossTerms) -> tuple[Tensor, Tensor]:
    """w C(r, A) per token and where the clip is active, with the terms' clip range and TIS weight."""
    surrogate, clipped = clipped_surrogate(
        logp, old_logp, adv, terms.get("eps_low", 0.2), terms.get("eps_high", 0.28)
    )
    is_weight = terms.get("is_weight")
    return (surrogate if is_weight is None else surrogate * is_weight.detach()), clipped


def _regularised(per_token: Tensor, logp: Tensor, terms: LossTerms) -> tuple[Tensor, Tensor | None]:
    """per_token - kl_coef k3 + entropy_coef H (each term only when it is on), and the k3 KL."""
    kl = None
    ref_logp, kl_coef = terms.get("ref_logp"), terms.get("kl_coef", 0.0)
    if ref_logp is not None and kl_coef != 0.0:
        kl = k3_kl(logp, ref_logp)
        per_token = per_token - kl_coef * kl
    entropy, entropy_coef = terms.get("entropy"), terms.get("entropy_coef", 0.0)
    if entropy is not None and entropy_coef != 0.0:
        per_token = per_token + entropy_coef * entropy
    return per_token, kl


def _parts(
    objective: Tensor, clipped: Tensor, kl: Tensor | None, mask: Tensor, terms: LossTerms
) -> LossParts:
    return LossParts(-objective, _mean(clipped, mask), _mean(kl, mask), _mean(terms.get("entropy"), mask))


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    aggregation: Aggregation = "token_mean",
    n_tokens: float | None = None,
    **terms: Unpack[LossTerms],
) -> LossParts:
    """-(agg[w C(r, A)] - kl_coef agg[k3] + entropy_coef agg[H]) with one aggregation for every term
    (``LossTerms``: the clip range, the KL and entropy terms, the weights)."""
    surrogate, clipped = _surrogate(logp, old_logp, adv, terms)
    per_token, kl = _regularised(surrogate, logp, terms)
    objective = aggregate(
        per_token,
        mask,
        aggregation,
        seq_weight=terms.get("seq_weight"),
        n_tokens=n_tokens,
        n_seqs=terms.get("n_seqs"),
    )
    return _parts(objective, clipped, kl, mask, terms)


def hrpo_token_weights(mask: Tensor, stream_mask: Tensor, lam: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token weights of the three HRPO terms (AdaSR eq. 10, the time-grouped form):
    w_s = lambda/|t_s| on streaming tokens, w_d = lambda/(|o| - |t_s|) on deep tokens, w_g = 1/|o|
    on every trained token; an empty phase has weight 0 everywhere (it contributes nothing)."""
    stream = stream_mask * mask
    deep = mask - stream
    n_s = stream.sum(dim=1, keepdim=True)
    n_d = deep.sum(dim=1, keepdim=True)
    n_o = mask.sum(dim=1, keepdim=True)
    w_s = torch.where(n_s > 0, lam / n_s.clamp(min=1.0), torch.zeros_like(n_s)) * stream
    w_d = torch.where(n_d > 0, lam / n_d.clamp(min=1.0), torch.zeros_like(n_d)) * deep
    w_g = torch.where(n_o > 0, 1.0 / n_o.clamp(min=1.0), torch.zeros_like(n_o)) * mask
    return w_s, w_d, w_g


def hrpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    adv_stream: Tensor,
    adv_deep: Tensor,
    adv_global: Tensor,
    mask: Tensor,
    stream_mask: Tensor,
    *,
    lam: float = 0.05,
    **terms: Unpack[LossTerms],
) -> LossParts:
    """-J_HRPO (AdaSR eq. 5, computed in the time-grouped form of eq. 10): per trajectory

        lambda/|t_s| sum_{t<=t_s} C(r_t, A^s) + lambda/(|o|-|t_s|) sum_{t>t_s} C(r_t, A^d)
        + 1/|o| sum_t (C(r_t, A^g) - kl_coef KL_t + entropy_coef H_t),

    averaged over trajectories (1/G per group, 1/B over the batch). One forward: all three terms share
    the same ratio r_t; at r = 1 the per-token gradient weights are appendix B eq. 17. ``is_weight``
    (TIS, learner/mismatch.py) multiplies each of the three surrogates per token.
    """
    w_s, w_d, w_g = hrpo_token_weights(mask, stream_mask, lam)
    c_s, clip_s = _surrogate(logp, old_logp, adv_stream, terms)
    c_d, clip_d = _surrogate(logp, old_logp, adv_deep, terms)
    c_g, clip_g = _surrogate(logp, old_logp, adv_global, terms)
    global_tok, kl = _regularised(c_g, logp, terms)
    per_seq = (w_s * c_s + w_d * c_d + w_g * global_tok).sum(dim=1)
    seq_weight, n_seqs = terms.get("seq_weight"), terms.get("n_seqs")
    if seq_weight is not None:
        per_seq = per_seq * seq_weight
    denom = n_seqs if n_seqs is not None else float(logp.shape[0])
    objective = per_seq.sum() / max(denom, 1.0)
    stream = stream_mask * mask
    clipped = torch.maximum(clip_g, torch.where(stream > 0, clip_s, clip_d))
    return _parts(objective, clipped, kl, mask, terms)


def pad_rows(rows: Sequence[Sequence[float]], width: int, device: Any) -> Tensor:
    """Ragged per-token rows as one [B, width] float tensor, zero-padded on the right."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, xs in enumerate(rows):
        if xs:
            out[r, : len(xs)] = torch.tensor(list(xs), dtype=torch.float32)
    return out.to(device)
