"""Attention per trajectory inside a packed row (docs/benchmarks/learner.md).

A packed row (learner/logprobs.py ``plan``) holds several trajectories one after the other. Under sdpa
with the row's block-diagonal mask the attention still computes every row x row score and masks most
of them away; here each trajectory's queries attend to its own keys only, one ``scaled_dot_product
_attention`` per trajectory, so attention costs sum(L_i^2) (causal: about half of it) instead of
rows x width^2. The projections and the MLP still run on all the row's tokens at once.

It is an attention function of transformers' attention interface (``ATTENTION``, registered under
that name with sdpa's mask function): ``use_segment_attention`` switches a model whose attention is
sdpa to it, once. Called with ``loom_segments`` (``segments``: an int64 tensor [n, 4] of row, start,
end, causal per trajectory) it attends per trajectory: interleaved trajectories under a plain causal
mask (sdpa's ``is_causal``, which skips the blocks above the diagonal), group-position ones under their
slice of the 4D boolean mask the caller passed (each trajectory's ``group_visibility``); padding after
the last trajectory of a row gets a zero output (never read: no real token attends to it). Called
without it (the padded path, a plain forward), it is sdpa itself, with sdpa's mask, so nothing changes
for the callers that do not pack. A sliding-window layer (the ``sliding_window`` transformers'
attention modules pass) gets its window on each trajectory's causal mask, as transformers' own
sliding mask (key k visible from query q iff q - window < k <= q); attention soft-capping is refused
(``loom.architectures.UnsupportedModel``: the learner loads soft-capped models with eager attention,
which this function never replaces). The attention is excluded from ``torch.compile`` (a graph break:
the per-trajectory loop depends on the batch), the rest of a compiled decoder layer is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from loom.architectures import UnsupportedModel

ATTENTION = "loom_segments"
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, segment_attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    _registered = True


def use_segment_attention(model: Any) -> bool:
    """Switch ``model``'s attention from sdpa to ``ATTENTION`` (idempotent); whether it now runs it.

    Other implementations (eager, chosen for attention weights; flash attention, whose variable-length
    kernels already read the restarting position ids; flex) are left as they are: the packed rows are
    then masked as before."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl == ATTENTION:
        return True
    if impl != "sdpa" or config is None:
        return False
    _register()
    config._attn_implementation = ATTENTION
    return True


def segments(bounds: Sequence[tuple[int, int, int, bool]]) -> Tensor:
    """The ``loom_segments`` tensor of (row, start, end, causal) per trajectory."""
    return torch.tensor([[r, s, e, int(c)] for r, s, e, c in bounds], dtype=torch.long).reshape(-1, 4)


@torch.compiler.disable
def segment_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    loom_segments: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """query [b, H, W, D], key/value [b, H_kv, W, D] -> attention output [b, W, H, D], no weights."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if loom_segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("softcap") is not None:
        raise UnsupportedModel(
            type(module).__name__, "attention soft-capping under segment attention", "the learner"
        )
    window = kwargs.get("sliding_window")
    n_rep = query.shape[1] // key.shape[1]
    b, heads, width, dim = query.shape
    bounds = loom_segments.tolist()
    sizes: list[int] = []  # the pieces of the flattened rows: trajectories and each row's padding
    spans: list[tuple[int, int, int, bool] | None] = []
    k = 0
    for r in range(b):
        filled = 0
        while k < len(bounds) and bounds[k][0] == r:
            _, s, e, causal = bounds[k]
            if s != filled or e <= s or e > width:
                raise ValueError(f"loom_segments: row {r}'s trajectories must tile it in order ({s}:{e})")
            if not causal and attention_mask is None:
                raise ValueError("loom_segments: a non-causal trajectory needs the 4D attention mask")
            sizes.append(e - s)
            spans.append((r, s, e, bool(causal)))
            filled, k = e, k + 1
        if filled < width:
            sizes.append(width - filled)
            spans.append(None)
    if k != len(bounds):
        raise ValueError("loom_segments: rows must be listed in order, within the batch")

    # [b, H, W, D] -> [b * W, H, D] split into pieces: one split (its backward is one cat), where
    # slicing each trajectory out of the 4D tensors would allocate a full-size gradient per slice
    def pieces(x: Tensor) -> tuple[Tensor, ...]:
        return x.transpose(1, 2).reshape(b * width, x.shape[1], dim).split(sizes)

    qs, ks, vs = pieces(query), pieces(key), pieces(value)
    outs: list[Tensor] = []
    for q, k_, v, span in zip(qs, ks, vs, spans, strict=True):
        if span is None:  # a row's padding: no real token attends to it, its output is never read
            outs.append(q.new_zeros(q.shape))
            continue
        r, s, e, causal = span
        mask = None if causal or attention_mask is None else attention_mask[r : r + 1, :, s:e, s:e]
        if causal and window is not None and e - s > window:
            i = torch.arange(e - s, device=q.device)
            mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k_.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scaling,
            enable_gqa=n_rep > 1,
        )
        outs.append(out[0].transpose(0, 1))  # [L, H, D]
    return torch.cat(outs).view(b, width, heads, dim), None
