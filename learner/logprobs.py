"""Log-prob recomputation on exactly the engine's token ids, with the engine's layout
(docs/algorithms.md §5.2).

Layouts:
- interleaved (default): the sequence ``prompt_ids + completion_ids`` under a plain causal mask;
  observation tokens (revealed sentences) are in the sequence, so thought t sees sentences <= t.
- group positions (StreamingThinker; a trajectory with ``meta["layout"] == "group_positions"``):
  every token has a group, source = 0 / target = 1; positions are numbered from 0 within each group
  and token i sees token j iff j <= i and group(j) <= group(i) (source never sees target), exactly
  the torch engine's ``block_mask``. Groups come from ``meta["groups"]`` (one per prompt+completion
  token), else ``meta["completion_groups"]`` (the streaming mode's record; prompt tokens are source),
  else: prompt tokens and ``observation`` segments are source, the rest target.

Micro-batches (``plan``) keep rows x row width within a token budget. Padded (``packing=False``): one
trajectory per row, rows as wide as the micro-batch's longest, longest first. Packed: trajectories,
longest first, into the emptiest of as few rows as fit within the batch's longest trajectory, position
ids restarting at each trajectory and attention kept inside it, so computed tokens ~= real tokens on
mixed lengths.
Interleaved rows carry no mask: the model's own packed-sequence masking reads the restarting position
ids (a block-diagonal causal mask under sdpa/eager, variable-length kernels under flash attention).
Group-position rows carry an explicit block-diagonal boolean mask [rows, 1, W, W] of each trajectory's
``group_visibility`` (flash attention takes no such mask: there the model must run sdpa or eager).
With ``segment_attention`` (the default) a model running sdpa attends per trajectory instead
(learner/segment_attention.py): one causal or group-masked sdpa per trajectory, so attention costs
sum(L_i^2), not rows x W^2, and the row's mask serves only the group-position trajectories' slices.

The head (``logprob_chunk`` > 0): the decoder's hidden states at the positions that predict completion
tokens only, through the output projection ``chunk`` tokens at a time inside one autograd function
(``_HeadLogProbs``) that keeps no logits for backward and recomputes each chunk there, so the
float32 tokens x vocabulary logits never exist at once; where a micro-batch's float32 logits fit in
``keep_logits_bytes`` (the learner's ``logprob_keep_mib``) it keeps them instead of recomputing (one
output-projection matmul fewer per token in the backward). ``logprob_chunk=0`` is the whole logits from
the model's forward, as before (and under FSDP, whose root owns the head's sharded weight).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from learner.segment_attention import segments, use_segment_attention
from loom.architectures import attention_of
from loom.contracts.wire import Trajectory
from loom.layout import group_positions, group_visibility

GROUP_LAYOUT = "group_positions"


@dataclass
class SeqLayout:
    input_ids: list[int]
    n_prompt: int
    groups: list[int] | None = None  # None = interleaved causal layout

    @property
    def n_completion(self) -> int:
        return len(self.input_ids) - self.n_prompt


def layout_of(t: Trajectory) -> SeqLayout:
    if not t.prompt_ids:
        raise ValueError(f"trajectory {t.id} has no prompt tokens; its first token has no context")
    ids = list(t.prompt_ids) + list(t.completion_ids)
    if t.meta.get("layout") != GROUP_LAYOUT:
        return SeqLayout(ids, len(t.prompt_ids))
    groups = t.meta.get("groups")
    if groups is None and t.meta.get("completion_groups") is not None:
        groups = [0] * len(t.prompt_ids) + list(t.meta["completion_groups"])
    if groups is not None:
        groups = [int(g) for g in groups]
        if len(groups) != len(ids):
            n = len(ids)
            raise ValueError(f"trajectory {t.id}: meta.groups has {len(groups)} entries for {n} tokens")
    else:
        comp = [1] * len(t.completion_ids)
        for seg in t.segments:
            if seg.kind == "observation":
                for j in range(seg.start, seg.end):
                    comp[j] = 0
        groups = [0] * len(t.prompt_ids) + comp
    return SeqLayout(ids, len(t.prompt_ids), groups)


def micro_batches(lengths: Sequence[int], token_budget: int, *, packing: bool = False) -> list[list[int]]:
    """Indices per micro-batch (``plan``'s rows flattened, in row order)."""
    return [[i for row in mb for i in row] for mb in plan(lengths, token_budget, packing=packing)]


def plan(lengths: Sequence[int], token_budget: int, *, packing: bool) -> list[list[list[int]]]:
    """Micro-batches of rows of indices with rows x row width <= token_budget (one over-long row alone).

    Padded: one index per row, rows as wide as the micro-batch's longest (longest first). Packed: as
    few rows as hold the batch within the longest length (so no attention span is wider than the
    padded layout's widest row), filled longest first into the emptiest row (LPT), a row more while
    one overflows; balanced rows leave ~1-3 % of a uniform 16-512 mix of 64-128 trajectories empty,
    where first-fit-decreasing leaves ~5 % (two long ones never share a row)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if not packing:
        batches: list[list[list[int]]] = []
        cur: list[list[int]] = []
        for i in order:
            longest = lengths[cur[0][0]] if cur else lengths[i]
            if cur and (len(cur) + 1) * longest > token_budget:
                batches.append(cur)
                cur = []
            cur.append([i])
        return batches + [cur] if cur else batches
    if not order:
        return []
    width = lengths[order[0]]
    n_rows = -(-sum(lengths) // width)
    while True:
        heap = [(0, r) for r in range(n_rows)]  # (fill, row): the emptiest row first
        rows: list[list[int]] = [[] for _ in range(n_rows)]
        fill = [0] * n_rows
        for i in order:
            _, r = heapq.heappop(heap)
            rows[r].append(i)
            fill[r] += lengths[i]
            heapq.heappush(heap, (fill[r], r))
        if max(fill) <= width:
            break
        n_rows += 1
    rows = [rows[r] for r in sorted(range(n_rows), key=lambda r: -fill[r])]
    per_batch = max(1, token_budget // width)
    return [rows[k : k + per_batch] for k in range(0, len(rows), per_batch)]


def budget_tokens(
    config: Any,
    memory_bytes: int,
    *,
    trainable: int,
    frozen: int,
    compute_bytes: int = 4,
    checkpointing: bool = False,
    chunk: int = 4096,
    kept_logits: int = 0,
) -> int:
    """The micro-batch token budget a memory budget allows, from the model's config (an estimate).

    Fixed: float32 weights (4 B) of every parameter, and for the trainable ones a gradient and AdamW's
    two moments (12 B); the head's float32 chunk and its recomputation (3 x chunk x vocab x 4 B), and
    the logits it may keep for backward (``kept_logits`` bytes at most). Per
    token, per decoder layer, the activations autograd keeps: ~16 hidden-wide and 5 intermediate-wide
    tensors in the compute dtype (norms, q/k/v/o, residuals, the SwiGLU gate/up/act), with activation
    checkpointing only the layer's input (hidden-wide) and one layer's working set."""
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", 4 * hidden))
    layers = int(config.num_hidden_layers)
    per_layer = (16 * hidden + 5 * inter) * compute_bytes
    per_token = (hidden * compute_bytes * layers + per_layer) if checkpointing else per_layer * layers
    per_token += 2 * hidden * 4  # the final hidden states kept for the head, and their gradient
    fixed = 4 * (trainable + frozen) + 12 * trainable + 3 * chunk * int(config.vocab_size) * 4 + kept_logits
    return max(1, (memory_bytes - fixed) // per_token)


def _rows(layouts: Sequence[SeqLayout], rows: Sequence[Sequence[int]] | None) -> list[list[int]]:
    return [list(r) for r in rows] if rows is not None else [[k] for k in range(len(layouts))]


def _packed_inputs(layouts: Sequence[SeqLayout], rows: list[list[int]], device: Any) -> dict[str, Tensor]:
    """Token ids and restarting position ids of the packed rows, and for group-position layouts the
    block-diagonal mask of each trajectory's ``group_visibility`` (padding tokens see themselves)."""
    width = max(sum(len(layouts[k].input_ids) for k in row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    grouped = any(layouts[k].groups is not None for row in rows for k in row)
    allowed = torch.zeros((len(rows), 1, width, width), dtype=torch.bool) if grouped else None
    for r, row in enumerate(rows):
        o = 0
        for k in row:
            x = layouts[k]
            n = len(x.input_ids)
            ids[r, o : o + n] = torch.tensor(x.input_ids)
            p = group_positions(x.groups) if x.groups is not None else list(range(n))
            pos[r, o : o + n] = torch.tensor(p)
            if allowed is not None:
                allowed[r, 0, o : o + n, o : o + n] = group_visibility(x.groups or [0] * n)
            o += n
        if allowed is not None:
            tail = torch.arange(o, width)
            allowed[r, 0, tail, tail] = True
    out = {"input_ids": ids.to(device), "position_ids": pos.to(device)}
    if allowed is not None:
        out["attention_mask"] = allowed.to(device)
    return out


def _segments(layouts: Sequence[SeqLayout], rows: list[list[int]]) -> Tensor:
    """(row, start, end, causal) of every trajectory in the packed rows (``segment_attention``)."""
    bounds = []
    for r, row in enumerate(rows):
        o = 0
        for k in row:
            n = len(layouts[k].input_ids)
            bounds.append((r, o, o + n, layouts[k].groups is None))
            o += n
    return segments(bounds)


def _completion_index(
    layouts: Sequence[SeqLayout], rows: list[list[int]], width: int, tc: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Flat indices (row * width + position) of the positions that predict completion tokens, the
    flat indices of those tokens, and where each lands in the [b, tc] output (b in rows' order)."""
    pred, dest = [], []
    b = 0
    for r, row in enumerate(rows):
        o = 0
        for k in row:
            x = layouts[k]
            n = x.n_completion
            pred.append(torch.arange(n) + (r * width + o + x.n_prompt - 1))
            dest.append(torch.arange(n) + b * tc)
            o += len(x.input_ids)
            b += 1
    p = torch.cat(pred)
    return p, p + 1, torch.cat(dest)


def _head_module(model: Any) -> Any:
    """The output projection when it is a plain bias-free Linear the fused head can use, else None
    (a LoRA-wrapped or biased head, an FSDP-sharded root, or a final-logit soft-cap, which the model's
    own forward applies to its logits and the fused head does not: then the model's own forward)."""
    from torch.distributed.fsdp import FSDPModule

    if getattr(getattr(model, "config", None), "final_logit_softcapping", None):
        return None
    if isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules()):
        return None
    head = model.get_output_embeddings()
    return head if type(head) is torch.nn.Linear and head.bias is None else None


class _HeadLogProbs(torch.autograd.Function):
    """log softmax(h W^T / T)[y] and the entropy of softmax(h W^T / T), ``chunk`` rows at a time; the
    backward recomputes each chunk's logits unless the float32 logits of all rows fit in ``keep_bytes``,
    then it keeps them (one output-projection matmul fewer per token, for n x vocabulary x 4 bytes):
    d logp_y / dz = onehot(y) - p, dH / dz = -p (z - E_p[z]), z = h W^T / T."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        temperature: float,
        chunk: int,
        dtype: torch.dtype | None,
        with_entropy: bool,
        keep_bytes: int = 0,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        keep = n * weight.shape[0] * 4 <= keep_bytes
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        logz = torch.empty_like(logp)
        mean_z = torch.zeros_like(logp)
        kept: list[Tensor] = []
        for s in range(0, n, chunk):
            e = s + chunk
            z = _chunk_logits(hidden[s:e], weight, dtype, temperature)
            top = z.amax(dim=-1, keepdim=True)
            ez = torch.exp(z - top)  # one exponential per logit for log Z and E_p[z] both
            total = ez.sum(-1)
            logz[s:e] = top.squeeze(1) + torch.log(total)
            logp[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - logz[s:e]
            if with_entropy:
                mean_z[s:e] = (ez.mul_(z)).sum(-1) / total
            if keep:
                kept.append(z)
        ctx.save_for_backward(hidden, weight, targets, logz, mean_z, *kept)
        ctx.temperature, ctx.chunk, ctx.dtype, ctx.with_entropy = temperature, chunk, dtype, with_entropy
        return logp, logz - mean_z if with_entropy else torch.zeros_like(logp)

    @staticmethod
    def backward(ctx: Any, g_logp: Tensor, g_ent: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, targets, logz, mean_z, *kept = ctx.saved_tensors
        dt = ctx.dtype or torch.float32
        g_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        g_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for k, s in enumerate(range(0, hidden.shape[0], ctx.chunk)):
            e = s + ctx.chunk
            h = hidden[s:e].to(dt)
            z = kept[k] if kept else _chunk_logits(hidden[s:e], weight, ctx.dtype, ctx.temperature)
            # dz = g_logp (onehot(y) - p) - g_ent p (z - E_p[z])
            #    = onehot(y) g_logp - p (g_logp + g_ent (z - E_p[z]))
            p = torch.exp(z - logz[s:e, None])
            if ctx.with_entropy:
                p.mul_((z - mean_z[s:e, None]).mul_(g_ent[s:e, None]).add_(g_logp[s:e, None]))
            else:
                p.mul_(g_logp[s:e, None])
            dz = p.neg_().scatter_add_(1, targets[s:e, None], g_logp[s:e, None])
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            dz = dz.to(dt)
            if g_hidden is not None:
                g_hidden[s:e] = (dz @ weight.to(dt)).to(hidden.dtype)
            if g_weight is not None and dt == torch.float32:
                g_weight.addmm_(dz.T, h)
            elif g_weight is not None:
                g_weight += (dz.T @ h).float()
        g_w = None if g_weight is None else g_weight.to(weight.dtype)
        return g_hidden, g_w, None, None, None, None, None, None


def _chunk_logits(h: Tensor, weight: Tensor, dtype: torch.dtype | None, temperature: float) -> Tensor:
    dt = dtype or torch.float32
    z = (h.to(dt) @ weight.to(dt).T).float()
    return z / temperature if temperature != 1.0 else z


def _model_inputs(layouts: Sequence[SeqLayout], device: Any) -> dict[str, Tensor]:
    b = len(layouts)
    width = max(len(x.input_ids) for x in layouts)
    ids = torch.zeros((b, width), dtype=torch.long)
    pos = torch.zeros((b, width), dtype=torch.long)
    for r, x in enumerate(layouts):
        n = len(x.input_ids)
        ids[r, :n] = torch.tensor(x.input_ids)
        p = group_positions(x.groups) if x.groups is not None else list(range(n))
        pos[r, :n] = torch.tensor(p)
    out = {"input_ids": ids.to(device), "position_ids": pos.to(device)}
    if any(x.groups is not None for x in layouts):
        allowed = torch.zeros((b, 1, width, width), dtype=torch.bool)
        for r, x in enumerate(layouts):
            n = len(x.input_ids)
            allowed[r, 0, :n, :n] = group_visibility(x.groups if x.groups is not None else [0] * n)
            allowed[r, 0, n:, 0] = True  # padding rows attend somewhere (never read)
        out["attention_mask"] = allowed.to(device)
    else:
        am = torch.zeros((b, width), dtype=torch.long)
        for r, x in enumerate(layouts):
            am[r, : len(x.input_ids)] = 1
        out["attention_mask"] = am.to(device)
    return out


@dataclass
class MicroBatchOut:
    index: list[int]  # positions in the caller's list
    logp: Tensor  # [b, T_c] log-prob of each completion token (0 in padding)
    entropy: Tensor | None  # [b, T_c] or None
    valid: Tensor  # [b, T_c] 1.0 where a completion token exists
    rows: list[list[int]] | None = None  # the packed rows (positions in ``index``); None: padded


def completion_logprobs(
    model: Any,
    layouts: Sequence[SeqLayout],
    *,
    rows: Sequence[Sequence[int]] | None = None,
    chunk: int = 0,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
    segment_attention: bool = True,
    keep_logits_bytes: int = 0,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One forward pass over ``layouts``; returns [b, T_c] completion log-probs, entropies, valid mask.

    ``rows``: positions in ``layouts`` packed per row, listed in ``layouts``' order (None: one per
    row, padded); ``chunk`` > 0: the fused chunked head (module docstring), which keeps its float32
    logits for backward when they fit in ``keep_logits_bytes``; ``segment_attention``: packed rows
    attend per trajectory (learner/segment_attention.py) where the model runs sdpa. Gradients flow
    when called outside ``torch.no_grad``. Logits are upcast to float32 and divided by ``temperature``: the
    log-probs of the distribution the rollout sampled from (verl's convention), so the gradient is the
    sampled policy's.
    """
    if any(x.groups is not None for x in layouts):  # no window over a group layout's keys
        attention_of(model.config, "the learner").refuse_layout("the learner")
    device = next(model.parameters()).device
    ctx: Any = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else torch.autocast(device_type=device.type, enabled=False)
    )
    if rows is not None or chunk > 0:
        return _packed_logprobs(
            model,
            layouts,
            _rows(layouts, rows),
            chunk,
            with_entropy,
            autocast_dtype,
            temperature,
            ctx,
            segment_attention and rows is not None,
            keep_logits_bytes,
        )
    inputs = _model_inputs(layouts, device)
    with ctx:
        logits = model(**inputs).logits
    tc = max(x.n_completion for x in layouts)
    b = len(layouts)
    # completion token j of row r sits at n_prompt + j and is predicted from position n_prompt + j - 1
    targets = torch.zeros((b, tc), dtype=torch.long, device=device)
    valid = torch.zeros((b, tc), dtype=torch.float32, device=device)
    gather_idx = torch.zeros((b, tc), dtype=torch.long, device=device)
    for r, x in enumerate(layouts):
        n = x.n_completion
        gather_idx[r, :n] = torch.arange(x.n_prompt - 1, x.n_prompt - 1 + n, device=device)
        targets[r, :n] = inputs["input_ids"][r, x.n_prompt : x.n_prompt + n]
        valid[r, :n] = 1.0
    picked = logits.gather(1, gather_idx[:, :, None].expand(-1, -1, logits.shape[-1])).float()
    if temperature != 1.0:
        picked = picked / temperature
    logz = torch.logsumexp(picked, dim=-1)
    logp = (picked.gather(2, targets[:, :, None]).squeeze(2) - logz) * valid
    entropy = None
    if with_entropy:
        probs = torch.softmax(picked, dim=-1)
        entropy = (logz - (probs * picked).sum(-1)) * valid
    return logp, entropy, valid


def _packed_logprobs(
    model: Any,
    layouts: Sequence[SeqLayout],
    rows: list[list[int]],
    chunk: int,
    with_entropy: bool,
    autocast_dtype: torch.dtype | None,
    temperature: float,
    ctx: Any,
    per_trajectory: bool,
    keep_bytes: int,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """``completion_logprobs`` on packed rows: the head only at the positions that predict a completion
    token, the results scattered back to [b, T_c] in ``layouts``' order."""
    if [k for row in rows for k in row] != list(range(len(layouts))):
        raise ValueError("rows must list every layout once, in order")
    device = next(model.parameters()).device
    inputs = _packed_inputs(layouts, rows, device)
    width = inputs["input_ids"].shape[1]
    b, tc = len(layouts), max(x.n_completion for x in layouts)
    pred, target_at, dest = (t.to(device) for t in _completion_index(layouts, rows, width, tc))
    targets = inputs["input_ids"].reshape(-1)[target_at]
    # attention per trajectory, not per row (learner/segment_attention.py)
    if per_trajectory and use_segment_attention(model):
        inputs["loom_segments"] = _segments(layouts, rows)
    head = _head_module(model) if chunk > 0 else None
    entropy_flat: Tensor | None = None
    with ctx:
        if head is None:
            logits = model(**inputs, use_cache=False).logits
            picked = logits.reshape(-1, logits.shape[-1])[pred].float()
        else:  # the restarting position ids are the packing: no cache may hide them (masking_utils)
            hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    if head is None:
        if temperature != 1.0:
            picked = picked / temperature
        logz = torch.logsumexp(picked, dim=-1)
        logp_flat = picked.gather(1, targets[:, None]).squeeze(1) - logz
        if with_entropy:
            entropy_flat = logz - (torch.softmax(picked, dim=-1) * picked).sum(-1)
    else:
        h = hidden.reshape(-1, hidden.shape[-1])[pred]
        logp_flat, ent = _HeadLogProbs.apply(
            h, head.weight, targets, temperature, chunk, autocast_dtype, with_entropy, keep_bytes
        )
        entropy_flat = ent if with_entropy else None

    def scatter(values: Tensor) -> Tensor:
        return values.new_zeros(b * tc).index_copy(0, dest, values).view(b, tc)

    valid = scatter(torch.ones_like(pred, dtype=torch.float32))
    return scatter(logp_flat), None if entropy_flat is None else scatter(entropy_flat), valid


def recompute(
    model: Any,
    trajectories: Sequence[Trajectory],
    *,
    token_budget: int = 8192,
    packing: bool = False,
    chunk: int = 0,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
    each: Callable[[MicroBatchOut], None] | None = None,
    temperature: float = 1.0,
    segment_attention: bool = True,
    keep_logits_bytes: int = 0,
) -> list[MicroBatchOut]:
    """Completion log-probs of every trajectory, micro-batched by ``token_budget`` (``plan``);
    ``packing``, ``chunk``, ``keep_logits_bytes`` and ``segment_attention`` as in the module docstring
    (packing and chunk off: one padded row per trajectory and the whole logits).

    With ``each`` the caller consumes every micro-batch as it is produced (e.g. loss + backward, so
    only one micro-batch's activations are alive) and nothing is kept.
    """
    layouts = [layout_of(t) for t in trajectories]
    out: list[MicroBatchOut] = []
    for mb_rows in plan([len(x.input_ids) for x in layouts], token_budget, packing=packing):
        idx = [i for row in mb_rows for i in row]
        local: list[list[int]] | None = None
        if packing:
            starts = [0]
            for row in mb_rows:
                starts.append(starts[-1] + len(row))
            local = [list(range(a, z)) for a, z in zip(starts, starts[1:], strict=False)]
        logp, ent, valid = completion_logprobs(
            model,
            [layouts[i] for i in idx],
            rows=local,
            chunk=chunk,
            with_entropy=with_entropy,
            autocast_dtype=autocast_dtype,
            temperature=temperature,
            segment_attention=segment_attention,
            keep_logits_bytes=keep_logits_bytes,
        )
        mb = MicroBatchOut(idx, logp, ent, valid, local)
        if each is not None:
            each(mb)
        else:
            out.append(mb)
    return out


def behaviour_matches(t: Trajectory, temperature: float) -> bool:
    """Whether ``t``'s behaviour log-probs are what the learner computes at ``temperature`` (the
    log-softmax of logits / temperature, no top-p or top-k): 'raw' ones at temperature 1, 'processed'
    ones whose recorded processing is this temperature alone. Only these may enter the ratio."""
    if t.logprobs is None:
        return False
    if t.logprobs_kind == "raw":
        return temperature == 1.0
    p = t.logprobs_processing
    return p is not None and math.isclose(p.temperature, temperature) and p.top_p >= 1.0 and p.top_k <= 0


def mismatch(behaviour: Tensor, recomputed: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the engine's behaviour log-probs are from the learner's recomputation on trained
    tokens: mean |diff|, max |diff| and the k3 KL(behaviour || learner) estimate."""
    d = (recomputed - behaviour) * mask
    n = float(mask.sum().item())
    if n == 0:
        return {"logprob_mismatch_mean": 0.0, "logprob_mismatch_max": 0.0, "logprob_mismatch_k3": 0.0}
    k3 = (torch.exp(d) - d - 1.0) * mask
    return {
        "logprob_mismatch_mean": float(d.abs().sum().item() / n),
        "logprob_mismatch_max": float(d.abs().max().item()),
        "logprob_mismatch_k3": float(k3.sum().item() / n),
    }
