"""The torch engine: transformers in-process (CPU or GPU), Loom's reference implementation.

- Prefix KV cache: finished sequences leave their KV cache behind (LRU, ``cache_entries``); a new
  request reuses the longest cached prefix (taken over if the whole entry matches, else copied and
  cropped) and computes only the rest, so streaming rounds and shared prefixes cost their new tokens.
  ``stats.prefill_tokens`` counts the prompt tokens actually computed.
- Batching (``batching=True``, the default): concurrent requests without a group layout are decoded
  together by one scheduler thread. Each request is prefilled on its own (prefix cache as above), its
  rows join the running batch at the next decode step (one left-padded batch KV cache: zero keys and
  values on the left, a 2D attention mask with 0 there, explicit per-row position ids; at most
  ``max_batch_rows`` rows), and every request keeps its own sampling params and seeded generator (its
  rows are sampled with its own generator, so a seeded request's tokens do not depend on its batch
  mates, up to float rounding). Rows finish independently and leave their cache in the prefix cache.
  An error in one request's prefill or sampling fails that request only; a failed batched forward
  fails the requests of that batch; no caller is left waiting. ``stats.extra``: ``decode_steps``,
  ``batched_steps`` (forwards with more than one row), ``peak_batch_rows`` / ``peak_batch_requests``
  (the most rows / requests in one forward). ``batching=False`` serialises every call (one request at
  a time, the previous behaviour); requests with a layout always take that single-request path, and
  FCI scoring, policy loads and cache resets wait for the running batch to end.
- Group layout (StreamingThinker): position ids numbered per group, block visibility mask
  (``base.Layout``); the same ``layout_tensors`` build the teacher-forced reference pass.
- Limits: a prompt with a token id outside the vocabulary, or one that fills the model's context
  (``max_position_embeddings``), is refused with ``InvalidPrompt``; ``max_tokens`` is capped at the
  room the context leaves (finish_reason "length" there), where vLLM would refuse the request.
- Sampling: temperature / top-k / top-p with a seeded generator, and vLLM's logits processors in
  vLLM's order (``process_logits``: allowed ids, min_tokens, logit bias, repetition / frequency /
  presence penalties; min_p after the temperature); the reported log-prob of a sampled
  token is the raw model log-prob (``logprobs_mode="raw"``, vLLM's default) or the log-prob under the
  processed (tempered, truncated) distribution (``"processed"``).
- ``stream`` gives every token as it is sampled (the OpenAI routes' ``stream=true``);
  ``prompt_logprobs`` scores a prompt in one forward pass (vLLM's ``prompt_logprobs``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from loom.layout import group_positions, group_visibility
from loom.schemas import MAX_ATTENTION_STEPS, PolicyVersion, SamplingParams
from rollout_svc.engines.base import (
    Completion,
    Engine,
    InvalidPrompt,
    Layout,
    Listener,
    PolicyLoadError,
    Progress,
    PromptLogprobs,
    UnsupportedCapability,
    check_prompt,
    check_sampling,
    check_scored,
)

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


def has_logits_processors(params: SamplingParams) -> bool:
    return bool(
        params.allowed_token_ids is not None
        or params.min_tokens
        or params.logit_bias
        or params.repetition_penalty != 1.0
        or params.presence_penalty
        or params.frequency_penalty
    )


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: list[int],
    outputs: list[list[int]],
    stop_ids: set[int],
) -> torch.Tensor:
    """vLLM's logits processors that run before the temperature, in vLLM's order (0.32,
    vllm/v1/sample/sampler.py): the allowed-token whitelist; ``min_tokens`` (a row with fewer than
    ``min_tokens`` outputs cannot sample ``stop_ids``: EOS and the stop token ids); the logit bias;
    then the penalties: repetition (tokens of the prompt or the output: a positive logit divided by
    it, a negative one multiplied), frequency (times the count in the output) and presence (once per
    token seen in the output). Row r of ``logits`` continues ``prompt_ids + outputs[r]``."""
    x = logits.clone()
    device = x.device
    if params.allowed_token_ids is not None:
        keep = torch.zeros(x.shape[-1], dtype=torch.bool, device=device)
        keep[torch.tensor(params.allowed_token_ids, device=device)] = True
        x.masked_fill_(~keep, float("-inf"))
    if params.min_tokens and stop_ids:
        short = [r for r, out in enumerate(outputs) if len(out) < params.min_tokens]
        if short:
            rows = torch.tensor(short, device=device)[:, None]
            x[rows, torch.tensor(sorted(stop_ids), device=device)[None, :]] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        x[:, ids] += torch.tensor(list(params.logit_bias.values()), dtype=x.dtype, device=device)
    if params.repetition_penalty != 1.0 or params.presence_penalty or params.frequency_penalty:
        counts = torch.zeros_like(x)
        for r, out in enumerate(outputs):
            if out:
                counts[r].index_add_(0, torch.tensor(out, device=device), torch.ones(len(out), device=device))
        in_output = counts > 0
        if params.repetition_penalty != 1.0:
            seen = in_output.clone()
            if prompt_ids:
                seen[:, torch.tensor(prompt_ids, device=device)] = True
            p = params.repetition_penalty
            x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
        x -= params.frequency_penalty * counts + params.presence_penalty * in_output
    return x


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


def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) tensors of every layer of a DynamicCache, each (batch, heads, seq, dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _dynamic_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = width
    return torch.cat([x.new_zeros(shape), x], dim=dim)


@dataclass
class _Request:
    """One batched ``generate`` call: its params, generator, outputs and the caller's future."""

    prompt_ids: list[int]
    params: SamplingParams
    future: Future[list[Completion]]
    key: list[tuple[int, int]] = field(default_factory=list)
    out: list[Completion] = field(default_factory=list)
    gen: torch.Generator | None = None
    live: int = 0  # rows of this request still decoding
    listener: Listener | None = None  # told of every accepted token (``TorchEngine.stream``)


@dataclass
class _Row:
    req: _Request
    sample: int  # index into req.out


@dataclass
class _Batch:
    """The running decode batch: rows, their left-padded KV cache, attention mask and next logits.

    Row b holds ``lengths[b]`` real tokens: the last ``lengths[b]`` positions of the cache (pads on
    the left, mask 0). ``logits[b]`` is the distribution its next token is sampled from."""

    rows: list[_Row] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None  # (rows, positions) long, 1 = real token
    lengths: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None


_LIVE: weakref.WeakSet[TorchEngine] = weakref.WeakSet()


def _stop_schedulers() -> None:
    for engine in list(_LIVE):
        engine.stop_scheduler()


# The scheduler thread is not a daemon, and the interpreter's shutdown lets it end first (the hook
# concurrent.futures uses for its workers, before non-daemon threads are joined): a daemon scheduler
# that ended while the interpreter was finalizing dropped the last reference to its engine there,
# and freeing the model's tensors re-took the GIL and aborted the process ("terminate called without
# an active exception", exit status 134, seen at the end of test runs).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_stop_schedulers)


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
        batching: bool = True,
        max_batch_rows: int = 64,
    ) -> None:
        super().__init__()
        self.model_path = Path(model_path)
        if model is not None:  # a model handed in decides the device (its inputs must live beside it)
            self.model = model
            self.device = str(next(model.parameters()).device)
        else:
            self.device = device
            self.model = load_model(self.model_path, device)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path)
        self.cache_entries = cache_entries
        self.logprobs_kind = logprobs_mode
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_entry = 0
        self._lock = threading.Lock()  # the model and the prefix cache: one user at a time
        # policy loads one at a time: from_pretrained is not thread-safe (transformers' meta-device
        # initialisation patches torch process-wide; two concurrent loads left one model on "meta")
        self._load_lock = threading.Lock()
        self._loaded: tuple[int, str] | None = None  # (version, path) of the last policy loaded
        self.batching = batching
        self.max_batch_rows = max(1, max_batch_rows)
        self._cv = threading.Condition()  # guards the scheduler state below
        self._pending: deque[_Request] = deque()
        self._want = 0  # threads waiting for exclusive use: the scheduler admits no new rows meanwhile
        self._worker: threading.Thread | None = None
        self._idle_s = 1.0  # the scheduler thread exits after this long without work
        self._closing = False
        _LIVE.add(self)
        for k in ("decode_steps", "batched_steps", "peak_batch_rows", "peak_batch_requests"):
            self.stats.extra[k] = 0.0
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))

    # ---------------------------------------------------------------------------------------------
    # interface

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        if self.batching and layout is None:
            params = self._fit(prompt_ids, params, layout)
            return await asyncio.wrap_future(self._submit(prompt_ids, params))
        return await asyncio.to_thread(self.generate_sync, prompt_ids, params, layout)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Progress]:
        """Every accepted token as it is sampled (the batching scheduler tells the request's listener,
        on the scheduler thread; the events cross to this loop in order)."""
        if not self.batching:
            async for progress in super().stream(prompt_ids, params):
                yield progress
            return
        params = self._fit(prompt_ids, params, None)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Progress] = asyncio.Queue()

        def listener(progress: Progress) -> None:
            loop.call_soon_threadsafe(events.put_nowait, progress)

        fut = self._submit(prompt_ids, params, listener)
        done: asyncio.Future[list[Completion]] = asyncio.wrap_future(fut)
        ended = 0
        try:
            while ended < params.n:
                if done.done() and events.empty():
                    done.result()  # the request failed: its error; else every event has been read
                    return
                get: asyncio.Future[Progress] = asyncio.ensure_future(events.get())
                await asyncio.wait((get, done), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                progress = get.result()
                ended += progress.ended
                yield progress
        finally:
            fut.cancel()  # a client that went away: drop the request if it has not started

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobs:
        return await asyncio.to_thread(self.prompt_logprobs_sync, token_ids, k)

    def prompt_logprobs_sync(self, token_ids: list[int], k: int) -> PromptLogprobs:
        """One forward pass over ``token_ids`` (no prefix cache), serialised with generation."""
        check_scored(list(token_ids), 0, self.vocab_size, self.max_model_len, 0)
        with self._exclusive(), torch.no_grad():
            logits = self.model(torch.tensor([token_ids], device=self.device)).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        actual = torch.tensor(token_ids[1:], device=logp.device)
        lp = logp.gather(1, actual[:, None])
        ranks = (logp > lp).sum(dim=-1) + 1
        top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1) if k > 0 else None
        out: PromptLogprobs = [None]
        for i, (t, v, rank) in enumerate(zip(token_ids[1:], lp[:, 0].tolist(), ranks.tolist(), strict=True)):
            d = {t: (v, rank)}
            if top is not None:
                ids, values = top.indices[i].tolist(), top.values[i].tolist()
                for j, (tid, tv) in enumerate(zip(ids, values, strict=True)):
                    d.setdefault(tid, (tv, j + 1))
            out.append(d)
        return out

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def max_model_len(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    async def load_policy(self, policy: PolicyVersion) -> None:
        await asyncio.to_thread(self.load_policy_sync, policy)

    async def reset_cache(self) -> None:
        await asyncio.to_thread(self.reset_cache_sync)

    def reset_cache_sync(self) -> None:
        with self._exclusive():
            self._entries.clear()

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the engine alone: the scheduler admits no new rows and hands over once its batch ends."""
        with self._cv:
            self._want += 1
        try:
            self._lock.acquire()
        finally:
            with self._cv:
                self._want -= 1
                self._cv.notify_all()
        try:
            yield
        finally:
            self._lock.release()

    async def score_attention(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        return await asyncio.to_thread(self.score_attention_sync, token_ids, steps, delta, zero_from)

    def score_attention_sync(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        """FCI scores (AttnRL eq. 5-6) by loom.fci's streaming pass, serialised with generation."""
        from loom.fci import fci_scores

        check_scored(list(token_ids), len(steps), self.vocab_size, self.max_model_len, MAX_ATTENTION_STEPS)
        with self._exclusive():
            return fci_scores(self.model, token_ids, steps, delta=delta, zero_from=zero_from)

    def load_policy_sync(self, policy: PolicyVersion) -> None:
        if policy.kind == "lora":
            raise UnsupportedCapability(self.name, "lora", "publish full checkpoints for the torch engine")
        with self._load_lock:
            if self._loaded == (policy.version, str(policy.path)):
                return  # several groups asked for the same new version: it is loaded once
            try:
                model = load_model(policy.path, self.device)
            except (OSError, ValueError) as exc:  # no such directory, not a checkpoint, an unknown model
                raise PolicyLoadError(f"could not load policy {policy.path!r}: {exc}") from exc
            with self._exclusive():
                self.model = model
                self._entries.clear()
                self.policy_version = policy.version
            self._loaded = (policy.version, str(policy.path))
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
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        gen: torch.Generator,
        prompt_ids: list[int] | None = None,
        outputs: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, their log-probs, the log-prob table the top-k log-probs are read from).

        ``outputs[r]`` are the tokens row r has generated so far and ``prompt_ids`` its prompt: the
        penalties and ``min_tokens`` read them (``process_logits``)."""
        raw = torch.log_softmax(logits, dim=-1)
        if has_logits_processors(params):
            stop = self.eos_ids | set(params.stop_token_ids)
            logits = process_logits(logits, params, prompt_ids or [], outputs or [[]] * len(logits), stop)
        if params.temperature == 0.0:
            tokens = logits.argmax(dim=-1)
            # vLLM's processed log-probs of a greedy request: after the processors, no temperature
            table = raw if self.logprobs_kind == "raw" else torch.log_softmax(logits, dim=-1)
        else:
            scaled = logits / params.temperature
            if params.min_p > 0.0:  # vLLM applies it after the temperature, before top-k / top-p
                probs = torch.softmax(scaled, dim=-1)
                floor = probs.amax(dim=-1, keepdim=True) * params.min_p
                scaled = scaled.masked_fill(probs < floor, float("-inf"))
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
        return tokens, table.gather(1, tokens[:, None]).squeeze(1), table

    def _stop_string(self, gen_ids: list[int], stops: list[str], start: int = 0) -> str | None:
        """The stop string in the text of the last tokens, looking no earlier than token ``start``
        (``min_tokens``: vLLM searches only the text after it)."""
        width = max(len(s) for s in stops) + 2
        tail = self.tokenizer.decode(gen_ids[max(start, len(gen_ids) - width) :], skip_special_tokens=True)
        for s in stops:
            if s in tail:
                return s
        return None

    def _generator(self, params: SamplingParams) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return gen

    @staticmethod
    def _outputs(params: SamplingParams) -> list[Completion]:
        out = [Completion(token_ids=[], logprobs=[]) for _ in range(params.n)]
        if params.logprobs:
            for c in out:
                c.top_logprobs = []
        return out

    def _accept(
        self, c: Completion, t: int, lp: float, top: Any, r: int, params: SamplingParams, stop_ids: set[int]
    ) -> bool:
        """Append token ``t`` (log-prob ``lp``, top-k row ``r`` of ``top``) to ``c``; True if ``c`` ends."""
        c.token_ids.append(t)
        c.logprobs.append(lp)
        if top is not None and c.top_logprobs is not None:
            d = {int(k): float(v) for k, v in zip(top.indices[r], top.values[r], strict=True)}
            d[t] = lp
            c.top_logprobs.append(d)
        if t in stop_ids:
            c.finish_reason, c.stop_reason = "stop", t
        elif t in self.eos_ids and not params.ignore_eos:
            c.finish_reason, c.stop_reason = "stop", None
        elif (
            params.stop
            and len(c.token_ids) > params.min_tokens
            and (s := self._stop_string(c.token_ids, params.stop, params.min_tokens)) is not None
        ):
            c.finish_reason, c.stop_reason = "stop", s
        elif len(c.token_ids) >= params.max_tokens:
            c.finish_reason = "length"
        else:
            return False
        return True

    def _fit(self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None) -> SamplingParams:
        """Refuse a prompt the model cannot read (``base.check_prompt``: ``InvalidPrompt``) and cap
        ``max_tokens`` at the room its context leaves, so a sample that reaches the end of the context
        ends with finish_reason "length". (vLLM answers 400 to prompt + max_tokens > max_model_len;
        the torch engine, and so ``loom engine``, serves what fits.) Under a group layout positions
        are numbered per group, and the generated tokens continue ``gen_group``'s."""
        if layout is not None and len(layout.groups) != len(prompt_ids):
            raise ValueError(f"layout has {len(layout.groups)} groups for {len(prompt_ids)} prompt tokens")
        check_sampling(params, self.vocab_size)
        limit = self.max_model_len
        if layout is None:
            room = check_prompt(prompt_ids, self.vocab_size, limit)
        else:
            check_prompt(prompt_ids, self.vocab_size, None)
            room = self.room(prompt_ids, layout)
            if room == 0:
                raise InvalidPrompt(
                    f"a group of the prompt's layout takes {max(Counter(layout.groups).values())} "
                    f"positions; the model's context holds {limit} (and at least one generated token)"
                )
        if room is not None and params.max_tokens > room:
            return params.model_copy(update={"max_tokens": room})
        return params

    def generate_sync(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        params = self._fit(prompt_ids, params, layout)
        if self.batching and layout is None:
            return self._submit(prompt_ids, params).result()
        with self._exclusive(), torch.no_grad():
            return self._generate_one(prompt_ids, params, layout)

    def _generate_one(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None
    ) -> list[Completion]:
        """One request alone (group layouts, ``batching=False``); the caller holds the engine."""
        groups = list(layout.groups) if layout is not None else [0] * len(prompt_ids)
        gen_group = layout.gen_group if layout is not None else 0
        masked = layout is not None
        key = list(zip(prompt_ids, groups, strict=True))
        n = params.n
        gen = self._generator(params)
        stop_ids = set(params.stop_token_ids)
        cache, logits, reuse = self._prefill_rows(key, groups, masked, n)
        out = self._outputs(params)
        for c in out:
            c.cached_tokens = reuse
        rows = list(range(n))  # sample index of each live batch row
        seq_groups = groups
        for step in range(params.max_tokens):
            outputs = [out[i].token_ids for i in rows]
            tokens, lps, table = self._sample(logits, params, gen, prompt_ids, outputs)
            top = torch.topk(table, params.logprobs, dim=-1) if params.logprobs else None
            done: list[int] = []
            for r, i in enumerate(rows):
                if self._accept(out[i], int(tokens[r]), float(lps[r]), top, r, params, stop_ids):
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

    # ---------------------------------------------------------------------------------------------
    # batching: one scheduler thread decodes every concurrent layout-free request in one batch

    def _submit(
        self, prompt_ids: list[int], params: SamplingParams, listener: Listener | None = None
    ) -> Future[list[Completion]]:
        fut: Future[list[Completion]] = Future()
        req = _Request(list(prompt_ids), params, fut, listener=listener)
        with self._cv:
            self._pending.append(req)
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="loom-torch-batch")
                self._worker.start()
            self._cv.notify_all()
        return fut

    @staticmethod
    def _fail(req: _Request, exc: BaseException) -> None:
        if not req.future.done():
            try:
                req.future.set_exception(exc)
            except Exception:  # cancelled or finished meanwhile
                pass

    def _serve(self) -> None:
        """The scheduler thread: runs batches while requests come, exits after ``_idle_s`` idle."""
        try:
            while True:
                with self._cv:
                    deadline = time.monotonic() + self._idle_s
                    while not self._pending or self._want:
                        left = deadline - time.monotonic()
                        if not self._pending and (left <= 0 or self._closing):
                            self._worker = None
                            return
                        self._cv.wait(left if not self._pending else None)
                with self._lock, torch.no_grad():
                    self._run()
        except BaseException as e:  # never leave callers waiting on a dead scheduler
            with self._cv:
                self._worker = None
                stranded = list(self._pending)
                self._pending.clear()
            for req in stranded:
                self._fail(req, RuntimeError(f"the torch engine scheduler stopped: {e!r}"))
            raise

    def stop_scheduler(self, timeout: float = 5.0) -> None:
        """Let an idle scheduler thread end now and wait for it (interpreter shutdown calls it)."""
        with self._cv:
            self._closing = True
            worker = self._worker
            self._cv.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        with self._cv:
            self._closing = False

    def _run(self) -> None:
        """Decode batches until no row is left (admitting new requests at every step)."""
        batch = _Batch()
        taken: list[_Request] = []
        try:
            while True:
                self._admit(batch, taken)
                if not batch.rows:
                    return
                self._step(batch)
                taken[:] = [req for req in taken if not req.future.done()]
        except Exception as e:  # a failed batched forward: every request of this batch gets the error
            log.exception("torch engine batch failed")
            for req in taken:
                self._fail(req, e)

    def _admit(self, batch: _Batch, taken: list[_Request]) -> None:
        with self._cv:
            if self._want:
                return
            room = self.max_batch_rows - len(batch.rows)
            new: list[_Request] = []
            while self._pending and (self._pending[0].params.n <= room or not (batch.rows or new)):
                req = self._pending.popleft()
                room -= req.params.n
                new.append(req)
        for req in new:
            if not req.future.set_running_or_notify_cancel():
                continue
            taken.append(req)
            try:
                cache, logits = self._prefill(req)
            except Exception as e:  # this request only
                self._fail(req, e)
                continue
            self._join(batch, req, cache, logits)

    def _prefill(self, req: _Request) -> tuple[Any, torch.Tensor]:
        params, ids = req.params, req.prompt_ids
        req.key = [(t, 0) for t in ids]
        req.gen = self._generator(params)
        req.out = self._outputs(params)
        req.live = params.n
        cache, logits, reuse = self._prefill_rows(req.key, [0] * len(ids), False, params.n)
        for c in req.out:
            c.cached_tokens = reuse
        return cache, logits

    def _prefill_rows(
        self, key: list[tuple[int, int]], groups: list[int], masked: bool, n: int
    ) -> tuple[Any, torch.Tensor, int]:
        """Prefill ``key`` past its longest cached prefix; the cache and next-token logits as n rows,
        and how many of its tokens the cache served."""
        cache, reuse = self._take_prefix(key)
        self.stats.requests += 1
        self.stats.cached_tokens += reuse
        self.stats.prefill_tokens += len(key) - reuse
        x = torch.tensor([[t for t, _ in key[reuse:]]], device=self.device)
        logits = self._forward(x, groups, reuse, cache, masked)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.expand(n, -1)
        return cache, logits, reuse

    def _join(self, batch: _Batch, req: _Request, cache: Any, logits: torch.Tensor) -> None:
        """Add the request's prefilled rows to the batch: left-pad the shorter side, stack the rows."""
        n, length = req.params.n, len(req.prompt_ids)
        ones = torch.ones(n, length, dtype=torch.long, device=self.device)
        if batch.mask is None or batch.logits is None:
            batch.cache, batch.mask, batch.lengths, batch.logits = cache, ones, [length] * n, logits
        else:
            width = batch.mask.shape[1]
            total = max(width, length)
            merged = [
                (
                    torch.cat([_pad_left(bk, total - width, 2), _pad_left(k, total - length, 2)]),
                    torch.cat([_pad_left(bv, total - width, 2), _pad_left(v, total - length, 2)]),
                )
                for (bk, bv), (k, v) in zip(_kv(batch.cache), _kv(cache), strict=True)
            ]
            batch.cache = _dynamic_cache(merged)
            batch.mask = torch.cat(
                [_pad_left(batch.mask, total - width, 1), _pad_left(ones, total - length, 1)]
            )
            batch.lengths = batch.lengths + [length] * n
            batch.logits = torch.cat([batch.logits, logits])
        batch.rows += [_Row(req, i) for i in range(n)]

    def _step(self, batch: _Batch) -> None:
        """Sample every row (each request with its own params and generator), retire finished rows
        (their caches go to the prefix cache), then one batched forward of the rest."""
        assert batch.mask is not None and batch.logits is not None
        by_req: dict[int, tuple[_Request, list[int]]] = {}
        for b, row in enumerate(batch.rows):
            by_req.setdefault(id(row.req), (row.req, []))[1].append(b)
        next_tokens = [0] * len(batch.rows)
        drop: set[int] = set()
        store: list[int] = []
        finished: list[_Request] = []
        for req, idx in by_req.values():
            params = req.params
            try:
                assert req.gen is not None
                sel = (
                    batch.logits[idx[0] : idx[-1] + 1]
                    if idx[-1] - idx[0] + 1 == len(idx)
                    else batch.logits[idx]
                )
                outputs = [req.out[batch.rows[b].sample].token_ids for b in idx]
                tokens, lps, table = self._sample(sel, params, req.gen, req.prompt_ids, outputs)
                top = torch.topk(table, params.logprobs, dim=-1) if params.logprobs else None
                toks, lp_list = tokens.tolist(), lps.tolist()
                stop_ids = set(params.stop_token_ids)
                ended: list[int] = []
                for r, b in enumerate(idx):
                    next_tokens[b] = toks[r]
                    sample = batch.rows[b].sample
                    c = req.out[sample]
                    end = self._accept(c, toks[r], lp_list[r], top, r, params, stop_ids)
                    if end:
                        ended.append(b)
                    if req.listener is not None:
                        req.listener(Progress(sample, c, len(c.token_ids), end))
            except Exception as e:  # this request only: drop its rows, keep decoding the others
                self._fail(req, e)
                drop.update(idx)
                continue
            drop.update(ended)
            store += ended
            req.live -= len(ended)
            if req.live == 0:
                finished.append(req)
        width = batch.mask.shape[1]
        if self.cache_entries > 0 and store:
            layers = _kv(batch.cache)
            for b in store:
                row, start = batch.rows[b], width - batch.lengths[b]
                c = row.req.out[row.sample]
                row_cache = _dynamic_cache(
                    [(k[b : b + 1, :, start:], v[b : b + 1, :, start:]) for k, v in layers]
                )
                self._store(row.req.key + [(t, 0) for t in c.token_ids[:-1]], row_cache)
        for req in finished:
            if not req.future.done():
                req.future.set_result(req.out)
        keep = [b for b in range(len(batch.rows)) if b not in drop]
        if not keep:
            batch.rows, batch.cache, batch.mask, batch.lengths, batch.logits = [], None, None, [], None
            return
        if len(keep) < len(batch.rows):
            sel_t = torch.tensor(keep, device=self.device)
            batch.cache.batch_select_indices(sel_t)
            batch.mask = batch.mask[sel_t]
            batch.rows = [batch.rows[b] for b in keep]
            batch.lengths = [batch.lengths[b] for b in keep]
            next_tokens = [next_tokens[b] for b in keep]
            start = width - max(batch.lengths)  # columns that are padding in every remaining row
            if start > 0:
                batch.cache = _dynamic_cache(
                    [(k[:, :, start:], v[:, :, start:]) for k, v in _kv(batch.cache)]
                )
                batch.mask = batch.mask[:, start:]
        rows = len(batch.rows)
        extra = self.stats.extra
        extra["decode_steps"] += 1
        extra["batched_steps"] += rows > 1
        extra["peak_batch_rows"] = max(extra["peak_batch_rows"], rows)
        extra["peak_batch_requests"] = max(extra["peak_batch_requests"], len({id(r.req) for r in batch.rows}))
        self.stats.decode_tokens += rows
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(rows, 1)], dim=1)
        x = torch.tensor(next_tokens, device=self.device)[:, None]
        pos = torch.tensor(batch.lengths, device=self.device)[:, None]
        batch.logits = (
            self.model(
                x, attention_mask=batch.mask, position_ids=pos, past_key_values=batch.cache, use_cache=True
            )
            .logits[:, -1, :]
            .float()
        )
        batch.lengths = [n + 1 for n in batch.lengths]
