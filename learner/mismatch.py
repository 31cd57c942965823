"""Rollout-train mismatch (docs/algorithms.md §5.2): how far the engine's sampling distribution
pi_behaviour is from the learner's own pi_old on the sampled tokens, and truncated importance
sampling (TIS) to correct the policy gradient for it.

The engine (vLLM's bf16 kernels, another attention implementation) and the learner compute different
log-probs for the same tokens. With TIS on, the PPO ratio is taken against the learner's own old
log-probs (r = pi_theta / pi_old, so the clip sees only the policy's move) and each token's surrogate
is weighted by the truncated importance weight of the behaviour policy (Yao et al., "Your efficient
RL framework secretly brings you off-policy RL training", 2025; verl's rollout IS, slime's TIS):

- token level:    w_t = min(pi_old(y_t) / pi_behaviour(y_t), C)
- sequence level: w_t = min(prod_t pi_old(y_t) / pi_behaviour(y_t), C), one weight for the sequence

The weight is a constant (no gradient). Pure torch on padded [B, T] tensors; masks are 0/1 floats.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loom.contracts.wire import TisLevel

LOG_WEIGHT_CLAMP = 20.0  # the sequence log-weight sums many tokens; exp stays finite in float32


def tis_weights(
    old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, level: TisLevel, cap: float
) -> Tensor:
    """The TIS weight of each token [B, T] (0 outside ``mask``; detached). ``level`` 'off': all ones
    on the mask. A row whose behaviour log-probs do not count is passed with ``mask`` 0 there by the
    caller and gets weight 1 from :func:`weights_or_one`."""
    mask = mask.detach()
    if level == "off":
        return mask.clone()
    log_w = (old_logp.detach() - behaviour_logp.detach()) * mask
    if level == "token":
        w = torch.exp(torch.clamp(log_w, max=LOG_WEIGHT_CLAMP))
    elif level == "sequence":
        seq = torch.clamp(log_w.sum(dim=1, keepdim=True), -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
        w = torch.exp(seq).expand_as(log_w)
    else:
        raise ValueError(f"unknown TIS level {level!r}")
    return torch.clamp(w, max=cap) * mask


def weights_or_one(weights: Tensor, known: Tensor) -> Tensor:
    """``weights`` on rows whose behaviour log-probs count (``known`` [B] bool), 1 on the others
    (no behaviour distribution to correct for: they are trained as on-policy rows)."""
    return torch.where(known[:, None], weights, torch.ones_like(weights))


def mismatch_log_ratio(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> Tensor:
    """log pi_old - log pi_behaviour on the masked tokens, a flat vector (the samples of the
    mismatch metrics: :func:`kl_k1`, :func:`kl_k3`, :func:`ratio_percentiles`)."""
    keep = mask.detach() > 0
    return (old_logp.detach() - behaviour_logp.detach())[keep]


def kl_k1(log_ratio: Tensor) -> float:
    """k1 estimate of KL(pi_behaviour || pi_old) from tokens sampled by pi_behaviour: mean(-log r),
    r = pi_old / pi_behaviour (unbiased, can be negative on a finite sample)."""
    return float((-log_ratio).mean()) if log_ratio.numel() else 0.0


def kl_k3(log_ratio: Tensor) -> float:
    """k3 estimate of the same KL (Schulman): mean(r - 1 - log r) >= 0 per token."""
    if not log_ratio.numel():
        return 0.0
    lr = torch.clamp(log_ratio, -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP)
    return float((torch.exp(lr) - 1.0 - lr).mean())


def ratio_percentiles(log_ratio: Tensor, qs: tuple[float, ...] = (0.05, 0.5, 0.95)) -> list[float]:
    """Percentiles of the token ratio r = pi_old / pi_behaviour (1.0 each when there is no sample)."""
    if not log_ratio.numel():
        return [1.0 for _ in qs]
    ratio = torch.exp(torch.clamp(log_ratio.double(), -LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    return [float(x) for x in torch.quantile(ratio, torch.tensor(qs, dtype=torch.float64))]
