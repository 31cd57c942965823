"""FCI attention scores of a response's steps (AttnRL eq. 6-7; ALGORITHMS.md 2.3), for engines that
cannot return attention weights (vLLM).

FCI(k) = max over layers l and heads h of sum_{j >= k + delta} alpha^{l,h}_{j,k}, where
alpha_{j,k} is the step-to-step attention: the mean of the token-level attention over the token pairs
(query in step j, key in step k). The prompt step (0), the first response step (1) and every step from
``zero_from`` on (e.g. from ``</think>``) score 0.

Memory: each layer's attention map is reduced to a [heads, steps, steps] matrix inside a forward hook
and dropped, so what is kept is O(layers * heads * steps), never an L x L map per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


def step_matrix(steps: Sequence[tuple[int, int]], length: int) -> Tensor:
    """[S, L] averaging matrix: row s is 1/|s| on step s's tokens."""
    p = torch.zeros((len(steps), length), dtype=torch.float32)
    for s, (a, b) in enumerate(steps):
        if not 0 <= a < b <= length:
            raise ValueError(f"step {s} = [{a}, {b}) is empty or outside the {length}-token sequence")
        p[s, a:b] = 1.0 / (b - a)
    return p


def fci_from_step_attention(alpha: Tensor, delta: int) -> Tensor:
    """alpha [H, S, S] (query step j, key step k) -> [S]: max over heads of sum_{j >= k+delta} alpha_{j,k}."""
    s = alpha.shape[-1]
    j = torch.arange(s)[:, None]
    k = torch.arange(s)[None, :]
    future = (j >= k + delta).to(alpha.dtype)
    return (alpha * future).sum(dim=-2).amax(dim=0)


@torch.no_grad()
def fci_scores(
    model: Any,
    token_ids: Sequence[int],
    steps: Sequence[tuple[int, int]],
    *,
    delta: int = 4,
    zero_from: int | None = None,
) -> list[float]:
    """FCI score of every step of ``token_ids`` (steps[0] is the prompt) under ``model``."""
    device = next(model.parameters()).device
    p = step_matrix(steps, len(token_ids)).to(device)
    best = torch.zeros(len(steps), device=device)
    hooks = []

    def reduce(_module: Any, _inputs: Any, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise RuntimeError("attention module returned no weights; load the model with eager attention")
        alpha = torch.einsum("sq,hqk,tk->hst", p, weights[0].float(), p)  # [H, S, S]
        torch.maximum(best, fci_from_step_attention(alpha, delta), out=best)

    layers = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not layers:
        raise RuntimeError("model has no '*.self_attn' modules to read attention from")
    previous = getattr(model.config, "_attn_implementation", None)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    try:
        for m in layers:
            hooks.append(m.register_forward_hook(reduce))
        model(input_ids=torch.tensor([list(token_ids)], device=device))
    finally:
        for h in hooks:
            h.remove()
        if previous is not None and hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation(previous)
    scores = best.tolist()
    for s in range(len(scores)):
        if s <= 1 or (zero_from is not None and s >= zero_from):
            scores[s] = 0.0
    return scores
