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

Sequences are packed into micro-batches whose padded size (rows x longest row) stays within a token
budget, longest first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

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


def micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that len(batch) * max length <= token_budget (one over-long row alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


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


def completion_logprobs(
    model: Any,
    layouts: Sequence[SeqLayout],
    *,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """One forward pass over ``layouts``; returns [b, T_c] completion log-probs, entropies, valid mask.

    Gradients flow when called outside ``torch.no_grad``. Logits are upcast to float32 and divided
    by ``temperature``: the log-probs of the distribution the rollout sampled from (verl's
    convention), so the gradient is the sampled policy's.
    """
    device = next(model.parameters()).device
    inputs = _model_inputs(layouts, device)
    ctx: Any = (
        torch.autocast(device_type=device.type, dtype=autocast_dtype)
        if autocast_dtype is not None
        else torch.autocast(device_type=device.type, enabled=False)
    )
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


def recompute(
    model: Any,
    trajectories: Sequence[Trajectory],
    *,
    token_budget: int = 8192,
    with_entropy: bool = False,
    autocast_dtype: torch.dtype | None = None,
    each: Callable[[MicroBatchOut], None] | None = None,
    temperature: float = 1.0,
) -> list[MicroBatchOut]:
    """Completion log-probs of every trajectory, micro-batched by ``token_budget``.

    With ``each`` the caller consumes every micro-batch as it is produced (e.g. loss + backward, so
    only one micro-batch's activations are alive) and nothing is kept.
    """
    layouts = [layout_of(t) for t in trajectories]
    out: list[MicroBatchOut] = []
    for idx in micro_batches([len(x.input_ids) for x in layouts], token_budget):
        logp, ent, valid = completion_logprobs(
            model,
            [layouts[i] for i in idx],
            with_entropy=with_entropy,
            autocast_dtype=autocast_dtype,
            temperature=temperature,
        )
        mb = MicroBatchOut(idx, logp, ent, valid)
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
