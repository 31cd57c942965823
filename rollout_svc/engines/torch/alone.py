"""One request decoded alone, its n samples as the rows of one batch: the path of group layouts
(StreamingThinker: positions numbered per group, block visibility mask, ``base.Layout``) and of
``batching=False``. The caller holds the engine (``TorchEngine._exclusive``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Completion, Layout
from rollout_svc.engines.torch.sampling import generator, new_outputs

if TYPE_CHECKING:
    from rollout_svc.engines.torch.engine import TorchEngine


def generate_alone(
    engine: TorchEngine, prompt_ids: list[int], params: SamplingParams, layout: Layout | None
) -> list[Completion]:
    """Decode ``params.n`` samples of ``prompt_ids``; finished rows leave the batch and their cache
    in the prefix cache."""
    groups = list(layout.groups) if layout is not None else [0] * len(prompt_ids)
    gen_group = layout.gen_group if layout is not None else 0
    masked = layout is not None
    key = list(zip(prompt_ids, groups, strict=True))
    gen = generator(params, engine.device)
    stop_ids = set(params.stop_token_ids)
    cache, logits, reuse = engine._prefill_rows(key, groups, masked, params.n)
    out = new_outputs(params)
    for c in out:
        c.cached_tokens = reuse
    rows = list(range(params.n))  # sample index of each live batch row
    seq_groups = groups
    for _ in range(params.max_tokens):
        outputs = [out[i].token_ids for i in rows]
        tokens, lps, table = engine._sample(logits, params, gen, prompt_ids, outputs)
        top = torch.topk(table, params.logprobs, dim=-1) if params.logprobs else None
        done = [
            r
            for r, i in enumerate(rows)
            if engine._accept(out[i], int(tokens[r]), float(lps[r]), top, r, params, stop_ids)
        ]
        for r in done:
            engine.prefix.retire(key, out[rows[r]].token_ids, gen_group, cache, r)
        if done:
            keep = [r for r in range(len(rows)) if r not in set(done)]
            if not keep:
                break
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=engine.device)
                cache.batch_select_indices(idx)
                tokens = tokens[idx]
            rows = [rows[r] for r in keep]
        seq_groups = seq_groups + [gen_group]
        engine.stats.decode_tokens += len(rows)
        logits = engine._forward(tokens[:, None], seq_groups, len(seq_groups) - 1, cache, masked)
    return out
