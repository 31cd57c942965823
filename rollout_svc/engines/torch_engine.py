"""The torch engine: transformers in-process (CPU or GPU), Loom's reference implementation.

- Prefix KV cache: finished sequences leave their KV cache behind (LRU, ``cache_entries``); a new
  request reuses the longest cached prefix (taken over if the whole entry matches, else copied and
  cropped) and computes only the rest, so streaming rounds and shared prefixes cost their new tokens.
  ``stats.prefill_tokens`` counts the prompt tokens actually computed.
- Group layout (StreamingThinker): position ids numbered per group, block visibility mask
  (``base.Layout``); the same ``layout_tensors`` build the teacher-forced reference pass.
- Sampling: temperature / top-k / top-p with a seeded generator; the reported log-prob of a sampled
  token is the raw model log-prob (``logprobs_mode="raw"``, vLLM's default) or the log-prob under the
  processed (tempered, truncated) distribution (``"processed"``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from loom.layout import group_positions, group_visibility
from loom.schemas import PolicyVersion, SamplingParams
from rollout_svc.engines.base import Completion, Engine, Layout, UnsupportedCapability

log = logging.getLogger("loom.rollout.torch")


def resolve_model_path(model: str) -> Path:
    """``tiny`` is Loom's built-in checkpoint; anything else is a Hugging Face model directory."""
    if model == "tiny":
        from loom.tiny import CHECKPOINT_DIR  # type: ignore[attr-defined]

        return Path(CHECKPOINT_DIR)
    return Path(model)


def load_model(path: str | Path, device: str = "cpu") -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def block_mask(groups: list[int], q_start: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Additive mask (1, 1, q, kv) for queries ``groups[q_start:]`` over keys ``groups``.

    Query i sees key j iff j <= i (causal) and groups[j] <= groups[i] (source never sees target).
    """
    allowed = group_visibility(groups, q_start, device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def teacher_forced_logprobs(
    model: Any, ids: list[int], start: int, layout: Layout | None = None
) -> list[float]:
    """Log-probs of ``ids[start:]`` in ONE forward pass over the whole sequence (the reference)."""
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    kwargs: dict[str, Any] = {}
    if layout is not None:
        groups = layout.groups + [layout.gen_group] * (len(ids) - len(layout.groups))
        kwargs["position_ids"] = torch.tensor([group_positions(groups)], device=device)
        kwargs["attention_mask"] = block_mask(groups, 0, torch.float32, device)
    logits = model(x, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
    return logp.gather(1, x[0, start:, None]).squeeze(1).tolist()


@dataclass
class _Entry:
    key: list[tuple[int, int]]  # (token id, group) of every position held in ``cache``
    cache: Any


def _common(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class TorchEngine(Engine):
    name = "torch"
    capabilities = frozenset({"group_positions", "prefix_cache", "attention_scores"})

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        cache_entries: int = 32,
        logprobs_mode: Literal["raw", "processed"] = "raw",
        model: Any = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__()
        self.model_path = Path(model_path)
        self.device = device
        self.model = model if model is not None else load_model(self.model_path, device)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path)
        self.cache_entries = cache_entries
        self.logprobs_kind = logprobs_mode
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_entry = 0
        self._lock = threading.Lock()
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))

    # ---------------------------------------------------------------------------------------------
    # interface

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        return await asyncio.to_thread(self.generate_sync, prompt_ids, params, layout)

    async def load_policy(self, policy: PolicyVersion) -> None:
        await asyncio.to_thread(self.load_policy_sync, policy)

    async def reset_cache(self) -> None:
        with self._lock:
            self._entries.clear()

    async def score_attention(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        return await asyncio.to_thread(self.score_attention_sync, token_ids, steps, delta, zero_from)

    def score_attention_sync(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        """FCI scores (AttnRL eq. 5-6) by loom.fci's streaming pass, serialised with generation."""
        from loom.fci import fci_scores

        with self._lock:
            return fci_scores(self.model, token_ids, steps, delta=delta, zero_from=zero_from)

    def load_policy_sync(self, policy: PolicyVersion) -> None:
        if policy.kind == "lora":
            raise UnsupportedCapability(self.name, "lora", "publish full checkpoints for the torch engine")
        model = load_model(policy.path, self.device)
        with self._lock:
            self.model = model
            self._entries.clear()
            self.policy_version = policy.version
        log.info("loaded policy version %d from %s", policy.version, policy.path)

    # ---------------------------------------------------------------------------------------------
    # prefix cache

    def _take_prefix(self, key: list[tuple[int, int]]) -> tuple[Any, int]:
        """A cache holding the longest cached prefix of ``key`` (at most len(key) - 1 tokens)."""
        from transformers import DynamicCache

        best_id, best_len = None, 0
        for eid, entry in self._entries.items():
            m = _common(entry.key, key)
            if m > best_len:
                best_id, best_len = eid, m
        reuse = min(best_len, len(key) - 1)
        if best_id is None or reuse <= 0:
            return DynamicCache(), 0
        entry = self._entries[best_id]
        if reuse == len(entry.key):  # the whole entry is a prefix: extend it in place
            del self._entries[best_id]
            return entry.cache, reuse
        cache = copy.deepcopy(entry.cache)
        cache.crop(reuse - len(entry.key))
        self._entries.move_to_end(best_id)
        return cache, reuse

    def _store(self, key: list[tuple[int, int]], cache: Any) -> None:
        if self.cache_entries <= 0 or not key:
            return
        self._entries[self._next_entry] = _Entry(key, cache)
        self._next_entry += 1
        while len(self._entries) > self.cache_entries:
            self._entries.popitem(last=False)

    # ---------------------------------------------------------------------------------------------
    # generation

    def _forward(self, ids: torch.Tensor, groups: list[int], start: int, cache: Any, masked: bool) -> Any:
        positions = group_positions(groups)[start:]
        kwargs: dict[str, Any] = {
            "position_ids": torch.tensor([positions], device=self.device).expand(ids.shape[0], -1),
            "past_key_values": cache,
            "use_cache": True,
        }
        if masked:
            kwargs["attention_mask"] = block_mask(groups, start, torch.float32, self.device).expand(
                ids.shape[0], -1, -1, -1
            )
        return self.model(ids, **kwargs).logits[:, -1, :].float()

    def _sample(
        self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, their log-probs, the log-prob table the top-k log-probs are read from)."""
        raw = torch.log_softmax(logits, dim=-1)
        if params.temperature == 0.0:
            tokens = logits.argmax(dim=-1)
            table = raw
        else:
            scaled = logits / params.temperature
            if params.top_k > 0 and params.top_k < scaled.shape[-1]:
                kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            if params.top_p < 1.0:
                sorted_l, order = torch.sort(scaled, dim=-1, descending=True)
                probs = torch.softmax(sorted_l, dim=-1)
                drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the smallest set reaching p
                sorted_l = sorted_l.masked_fill(drop, float("-inf"))
                scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_l)
            processed = torch.log_softmax(scaled, dim=-1)
            tokens = torch.multinomial(processed.exp(), 1, generator=gen).squeeze(1)
            table = raw if self.logprobs_kind == "raw" else processed
        if self.logprobs_kind == "processed" and params.temperature == 0.0:
            table = raw
        return tokens, table.gather(1, tokens[:, None]).squeeze(1), table

    def _stop_string(self, gen_ids: list[int], stops: list[str]) -> str | None:
        width = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(gen_ids[-width:], skip_special_tokens=True)
        for s in stops:
            if s in tail:
                return s
        return None

    def generate_sync(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if layout is not None and len(layout.groups) != len(prompt_ids):
            raise ValueError(f"layout has {len(layout.groups)} groups for {len(prompt_ids)} prompt tokens")
        groups = list(layout.groups) if layout is not None else [0] * len(prompt_ids)
        gen_group = layout.gen_group if layout is not None else 0
        masked = layout is not None
        key = list(zip(prompt_ids, groups, strict=True))
        n = params.n
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        stop_ids = set(params.stop_token_ids)
        with self._lock, torch.no_grad():
            cache, reuse = self._take_prefix(key)
            self.stats.requests += 1
            self.stats.cached_tokens += reuse
            self.stats.prefill_tokens += len(prompt_ids) - reuse
            x = torch.tensor([prompt_ids[reuse:]], device=self.device)
            logits = self._forward(x, groups, reuse, cache, masked)
            if n > 1:
                cache.batch_repeat_interleave(n)
                logits = logits.expand(n, -1)
            out = [Completion(token_ids=[], logprobs=[]) for _ in range(n)]
            if params.logprobs:
                for c in out:
                    c.top_logprobs = []
            rows = list(range(n))  # sample index of each live batch row
            seq_groups = groups
            for step in range(params.max_tokens):
                tokens, lps, table = self._sample(logits, params, gen)
                top = torch.topk(table, params.logprobs, dim=-1) if params.logprobs else None
                done: list[int] = []
                for r, i in enumerate(rows):
                    c = out[i]
                    t = int(tokens[r])
                    c.token_ids.append(t)
                    c.logprobs.append(float(lps[r]))
                    if top is not None and c.top_logprobs is not None:
                        d = {int(k): float(v) for k, v in zip(top.indices[r], top.values[r], strict=True)}
                        d[t] = float(lps[r])
                        c.top_logprobs.append(d)
                    if t in stop_ids:
                        c.finish_reason, c.stop_reason = "stop", t
                        done.append(r)
                    elif t in self.eos_ids:
                        c.finish_reason, c.stop_reason = "stop", None
                        done.append(r)
                    elif params.stop and (s := self._stop_string(c.token_ids, params.stop)) is not None:
                        c.finish_reason, c.stop_reason = "stop", s
                        done.append(r)
                    elif step == params.max_tokens - 1:
                        c.finish_reason = "length"
                        done.append(r)
                fed = len(prompt_ids) + step  # tokens held in the cache for every live row
                for r in done:
                    i = rows[r]
                    row_cache = cache if len(rows) == 1 else copy.deepcopy(cache)
                    if len(rows) > 1:
                        row_cache.batch_select_indices(torch.tensor([r], device=self.device))
                    self._store(
                        key + [(t, gen_group) for t in out[i].token_ids[: fed - len(prompt_ids)]], row_cache
                    )
                if done:
                    keep = [r for r in range(len(rows)) if r not in set(done)]
                    if not keep:
                        break
                    if len(keep) < len(rows):
                        idx = torch.tensor(keep, device=self.device)
                        cache.batch_select_indices(idx)
                        tokens = tokens[idx]
                    rows = [rows[r] for r in keep]
                seq_groups = seq_groups + [gen_group]
                self.stats.decode_tokens += len(rows)
                logits = self._forward(tokens[:, None], seq_groups, len(seq_groups) - 1, cache, masked)
        return out
