"""FCI (Forward Context Influence) scores of a response's steps (AttnRL eq. 5-6; docs/algorithms.md §2.3).

    y_k^{l,h} = sum_{j >= k + delta} alpha^{l,h}_{j,k}          (eq. 5)
    y_k       = max_{l,h} y_k^{l,h}                             (eq. 6)

``alpha_{j,k}`` is the step-to-step attention: the mean of the token-level attention over the token
pairs (query in step j, key in step k). The prompt step (0), the first response step (1) and every
step from ``zero_from`` on (e.g. from ``</think>``) score 0.

Streaming scorer (``fci_scores``): one forward pass of a transformers model whose attention is a
custom function (registered as ``"loom_fci"``) that computes causal attention block by block of
``block`` queries, reduces each block's probabilities to step sums on the spot (a cumulative sum over
keys read at the step boundaries) and keeps only a running max [S] over layers and heads. Nothing of
size L x L is ever materialised: the transient memory is O(heads x block x L), what is kept is O(S).
The attention output is computed exactly (same softmax), so later layers see what they would see.
Supported: models whose attention goes through ``ALL_ATTENTION_FUNCTIONS`` with a causal mask, a
layer's sliding window (the ``sliding_window`` the attention module passes: key k visible from query q
iff q - window < k <= q, transformers' rule) and attention soft-capping (``softcap``: scores ->
c tanh(scores / c), Gemma2's eager attention) applied as the model applies them: the architectures of
``loom.architectures``. No padding, no cache; attention sinks are refused (``UnsupportedModel``).

Shared by the torch engine (``loom engine``'s ``/v1/score/attention``) and the learner's endpoint of
the same name (for deployments whose engine is vLLM, which exposes no attention).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from loom.architectures import UnsupportedModel

ATTN_NAME = "loom_fci"
DELTA = 4


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
    j = torch.arange(s, device=alpha.device)[:, None]
    k = torch.arange(s, device=alpha.device)[None, :]
    future = (j >= k + delta).to(alpha.dtype)
    return (alpha * future).sum(dim=-2).amax(dim=0)


def zero_rules(scores: Sequence[float], zero_from: int | None) -> list[float]:
    """The prompt step, the first response step and the steps from ``zero_from`` on score 0."""
    return [
        0.0 if s <= 1 or (zero_from is not None and s >= zero_from) else float(v)
        for s, v in enumerate(scores)
    ]


# ------------------------------------------------------------------------------------------------
# streaming attention


@dataclass
class _Accumulator:
    steps: list[tuple[int, int]]
    query_avg: Tensor  # [S, L] averaging matrix of the query side (1/|j| on step j)
    key_size: Tensor  # [S] |k|
    delta: int
    block: int
    best: Tensor  # [S] running max over layers and heads of eq. 5


_active = threading.local()


def _step_sums(probs: Tensor, starts: Tensor, ends: Tensor) -> Tensor:
    """probs [H, q, L] -> [H, q, S]: the sum of each query's probabilities over each step's keys."""
    cs = torch.nn.functional.pad(probs.cumsum(dim=-1), (1, 0))  # cs[..., i] = sum of probs[..., :i]
    return cs[..., ends] - cs[..., starts]


def _fci_attention(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention in query blocks that feeds each block's step sums to the active accumulator."""
    acc: _Accumulator | None = getattr(_active, "acc", None)
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModel(type(module).__name__, "attention sinks", "the FCI scorer")
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    b, h, q_len, _ = query.shape
    kv_len = key.shape[2]
    if b != 1 or q_len != kv_len:
        raise RuntimeError("the FCI scorer runs one full sequence (batch 1, no cache)")
    groups = h // key.shape[1]
    if groups > 1:  # grouped-query attention: repeat key/value heads
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q, k, v = query[0], key[0], value[0]
    out = torch.empty_like(q)
    steps_t = None
    if acc is not None:
        steps_t = (
            torch.tensor([a for a, _ in acc.steps], device=q.device),
            torch.tensor([e for _, e in acc.steps], device=q.device),
        )
        alpha = torch.zeros((h, len(acc.steps), len(acc.steps)), device=q.device, dtype=torch.float32)
    block = acc.block if acc is not None else 256
    keys = torch.arange(kv_len, device=q.device)
    for a in range(0, q_len, block):
        e = min(q_len, a + block)
        scores = torch.matmul(q[:, a:e], k[:, :e].transpose(-1, -2)).float() * scaling  # [H, q, e]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        queries = torch.arange(a, e, device=q.device)[:, None]
        hidden = keys[None, :e] > queries  # causal
        if window is not None:
            hidden |= keys[None, :e] <= queries - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        del scores
        out[:, a:e] = torch.matmul(probs.to(v.dtype), v[:, :e])
        if acc is not None and steps_t is not None:
            starts, ends = steps_t
            sums = _step_sums(probs, starts.clamp(max=e), ends.clamp(max=e))  # [H, q, S]
            alpha += torch.matmul(acc.query_avg[:, a:e], sums)  # [H, S, S], query-step means
        del probs
    if acc is not None:
        alpha /= acc.key_size[None, None, :]  # key-step means
        torch.maximum(acc.best, fci_from_step_attention(alpha, acc.delta), out=acc.best)
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


@contextmanager
def _attention(model: Any, name: str) -> Iterator[None]:
    """``model`` with attention implementation ``name`` inside, its own again after."""
    previous = getattr(model.config, "_attn_implementation", None)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        if previous is not None:
            model.set_attn_implementation(previous)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _fci_attention)


@torch.no_grad()
def fci_scores(
    model: Any,
    token_ids: Sequence[int],
    steps: Sequence[tuple[int, int]],
    *,
    delta: int = DELTA,
    zero_from: int | None = None,
    block: int = 256,
) -> list[float]:
    """FCI score of every step of ``token_ids`` (steps[0] is the prompt) under ``model``.

    One streaming forward pass (module docstring). The caller serialises calls on a shared model: the
    model's attention implementation is switched for the pass and restored after it.
    """
    if delta < 1:
        raise ValueError("delta must be >= 1")
    if len(token_ids) < 1 or not steps:
        raise ValueError("need a non-empty sequence and at least one step")
    device = next(model.parameters()).device
    spans = [(int(a), int(b)) for a, b in steps]
    p = step_matrix(spans, len(token_ids)).to(device)
    acc = _Accumulator(
        steps=spans,
        query_avg=p,
        key_size=torch.tensor([float(b - a) for a, b in spans], device=device),
        delta=delta,
        block=max(1, block),
        best=torch.zeros(len(spans), device=device),
    )
    _register()
    with _attention(model, ATTN_NAME):
        _active.acc = acc
        try:
            kwargs: dict[str, Any] = {"use_cache": False}
            model(input_ids=torch.tensor([list(token_ids)], device=device), logits_to_keep=1, **kwargs)
        finally:
            _active.acc = None
    return zero_rules(acc.best.tolist(), zero_from)


@torch.no_grad()
def fci_scores_eager(
    model: Any,
    token_ids: Sequence[int],
    steps: Sequence[tuple[int, int]],
    *,
    delta: int = DELTA,
    zero_from: int | None = None,
) -> list[float]:
    """Reference: the same scores from ``output_attentions=True`` (every layer's L x L map kept)."""
    device = next(model.parameters()).device
    p = step_matrix([(int(a), int(b)) for a, b in steps], len(token_ids)).to(device)
    with _attention(model, "eager"):
        out = model(input_ids=torch.tensor([list(token_ids)], device=device), output_attentions=True)
    best = torch.zeros(len(steps), device=device)
    for att in out.attentions:  # [1, H, L, L]
        alpha = torch.einsum("sq,hqk,tk->hst", p, att[0].float(), p)
        torch.maximum(best, fci_from_step_attention(alpha, delta), out=best)
    return zero_rules(best.tolist(), zero_from)
