"""The batching scheduler: one thread decodes every concurrent layout-free request in one batch.

The requests admitted together are prefilled in one left-padded forward (those with a cached prefix
one by one, past their prefix: the prefix cache), and their rows join the running batch at the next
decode step: their keys and values are copied into the batch's static KV cache (``kv.StaticKv``:
preallocated, left-padded, every step written in place into one column, a boolean mask of each
row's real tokens, explicit per-row position ids), and the decode forward is ``decode.DecodeStep``
(eager; or with static shapes, captured in CUDA graphs on CUDA with ``cuda_graphs``). Rows in
flight are bounded by a KV-memory budget
(``KvBudget``: every row reserves its prompt plus ``max_tokens`` positions at the batch's widest),
and by ``max_rows`` when one is set. Every request keeps its own sampling params and seeded
generator, so a seeded request's tokens do not depend on its batch mates (up to float rounding).
Rows finish independently and leave their cache in the prefix cache. An error in one request's
prefill or sampling fails that request only (a failed batched prefill is retried request by
request); a failed batched forward fails the requests of that batch; no caller is left waiting.

The scheduler works through its engine's model, prefix cache, ``_prefill_batch``, ``_prefill_rows``,
``_sample`` and ``_accept`` (read at every use: a policy load swaps the model, tests wrap the methods)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from loom.contracts.wire import SamplingParams
from loom.timeline import mark
from rollout_svc.engines.base import Completion, Listener, Progress
from rollout_svc.engines.torch.decode import DecodeStep, Mode
from rollout_svc.engines.torch.kv import StaticKv, allocate
from rollout_svc.engines.torch.lora import LoraAdapter
from rollout_svc.engines.torch.prefix_cache import Key
from rollout_svc.engines.torch.sampling import TopRows, generator, is_plain, new_outputs, sample_rows

if TYPE_CHECKING:
    from rollout_svc.engines.torch.engine import TorchEngine

log = logging.getLogger("loom.rollout.torch")


@dataclass
class Request:
    """One batched ``generate`` call: its params, generator, outputs and the caller's future."""

    prompt_ids: list[int]
    params: SamplingParams
    future: Future[list[Completion]]
    key: Key = field(default_factory=list)
    out: list[Completion] = field(default_factory=list)
    gen: torch.Generator | None = None
    live: int = 0  # rows of this request still decoding
    listener: Listener | None = None  # told of every accepted token (``TorchEngine.stream``)
    adapter: LoraAdapter | None = None  # its LoRA adapter (``lora``); None: the base model

    @property
    def tag(self) -> int:
        """The group of its prefix-cache keys: 0, or its adapter's own (``lora.LoraAdapter.tag``)."""
        return 0 if self.adapter is None else self.adapter.tag


Drawn = tuple[list[int], list[float], Any]  # a request's rows: tokens, log-probs, top log-probs


@dataclass
class Row:
    req: Request
    sample: int  # index into req.out


@dataclass(frozen=True)
class KvBudget:
    """The KV cache rows in flight may fill: ``bytes`` in all, ``per_token`` for one position of one
    row (keys and values of every layer)."""

    per_token: int
    bytes: int

    def fits(self, rows: int, positions: int) -> bool:
        """Whether ``rows`` left-padded rows of ``positions`` positions each fit."""
        return rows * positions * self.per_token <= self.bytes


def kv_bytes_per_token(config: Any, dtype: str) -> int:
    """Keys and values of one position in every layer: 2 x layers x KV heads x head dim x the
    dtype's size (a model config without these fields counts as one byte per position)."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (layers and heads and hidden):
        return 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return 2 * int(layers) * int(kv_heads) * int(head_dim) * getattr(torch, dtype).itemsize


CPU_KV_BUDGET = 1 << 30  # 1 GiB of host memory for the KV cache of the rows in flight


def default_kv_budget(device: str) -> int:
    """Half the device memory free once the model is loaded on CUDA; ``CPU_KV_BUDGET`` on CPU."""
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free) // 2
    return CPU_KV_BUDGET


@dataclass
class Batch:
    """The running decode batch: rows, their static KV cache and next logits.

    Row b holds ``lengths[b]`` real tokens: the last ``lengths[b]`` used columns of row b of ``kv``
    (pads on the left, masked). ``logits[b]`` is the distribution its next token is sampled from."""

    rows: list[Row] = field(default_factory=list)
    kv: StaticKv | None = None
    lengths: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None


def fail(req: Request, exc: BaseException) -> None:
    if not req.future.done():
        try:
            req.future.set_exception(exc)
        except Exception:  # cancelled or finished meanwhile
            pass


_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


def _stop_schedulers() -> None:
    for scheduler in list(_LIVE):
        scheduler.stop()


# The scheduler thread is not a daemon, and the interpreter's shutdown lets it end first (the hook
# concurrent.futures uses for its workers, before non-daemon threads are joined): a daemon scheduler
# that ended while the interpreter was finalizing dropped the last reference to its engine there,
# and freeing the model's tensors re-took the GIL and aborted the process ("terminate called without
# an active exception", exit status 134, seen at the end of test runs).
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_stop_schedulers)


class Scheduler:
    """The engine's lock (one user of the model and the prefix cache at a time) and its batching
    thread, started by the first request and ended after ``idle_s`` without work."""

    def __init__(
        self, engine: TorchEngine, budget: KvBudget, max_rows: int | None = None, mode: Mode = "eager"
    ) -> None:
        self.engine = engine
        self.decode = DecodeStep(mode)
        self.kv: StaticKv | None = None  # kept between batches (its buffers, and graphs captured on them)
        self.budget = budget
        self.max_rows = max(1, max_rows) if max_rows is not None else None
        self.lock = threading.Lock()  # the model and the prefix cache: one user at a time
        self._cv = threading.Condition()  # guards the scheduler state below
        self.pending: deque[Request] = deque()
        self._want = 0  # threads waiting for exclusive use: the scheduler admits no new rows meanwhile
        self._worker: threading.Thread | None = None
        self.idle_s = 1.0  # the scheduler thread exits after this long without work
        # a new batch starts once no request has come for ``settle_s`` (at most ``settle_max_s``):
        # a burst of submissions (one call's groups, a bench's rows) is prefilled in one forward and
        # decoded in step, not split into waves that each cost a prefill and a ragged last step
        self.settle_s, self.settle_max_s = 0.003, 0.03
        self._last_submit = 0.0
        self._staged = threading.local()  # what this thread's event loop submitted this turn (``submit``)
        self._closing = False
        _LIVE.add(self)
        for k in ("decode_steps", "batched_steps", "peak_batch_rows", "peak_batch_requests"):
            engine.stats.extra[k] = 0.0

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        listener: Listener | None = None,
        adapter: LoraAdapter | None = None,
    ) -> Future[list[Completion]]:
        """Queue a request. From an event loop's thread it is staged and queued with the others that
        loop's ready tasks submit in the same turn (one ``call_soon``: an ``asyncio.gather`` of many
        calls reaches the scheduler as one burst, admitted and prefilled together)."""
        fut: Future[list[Completion]] = Future()
        req = Request(list(prompt_ids), params, fut, listener=listener, adapter=adapter)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            self._enqueue([req])
            return fut
        staged: list[Request] | None = getattr(self._staged, "reqs", None)
        if staged is None:
            staged = self._staged.reqs = []
            loop.call_soon(self._flush)
        staged.append(req)
        return fut

    def _flush(self) -> None:
        """Queue what this thread's event loop staged (``submit``)."""
        reqs, self._staged.reqs = self._staged.reqs, None
        self._enqueue(reqs)

    def _enqueue(self, reqs: list[Request]) -> None:
        with self._cv:
            self.pending.extend(reqs)
            self._last_submit = time.monotonic()
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="loom-torch-batch")
                self._worker.start()
            self._cv.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine alone: the scheduler admits no new rows and hands over once its batch ends."""
        with self._cv:
            self._want += 1
        try:
            self.lock.acquire()
        finally:
            with self._cv:
                self._want -= 1
                self._cv.notify_all()
        try:
            yield
        finally:
            self.lock.release()

    def stop(self, timeout: float = 5.0) -> None:
        """Let an idle scheduler thread end now and wait for it (interpreter shutdown calls it)."""
        with self._cv:
            self._closing = True
            worker = self._worker
            self._cv.notify_all()
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
        with self._cv:
            self._closing = False

    def _serve(self) -> None:
        """The scheduler thread: runs batches while requests come, exits after ``idle_s`` idle."""
        try:
            while True:
                with self._cv:
                    deadline = time.monotonic() + self.idle_s
                    while not self.pending or self._want:
                        left = deadline - time.monotonic()
                        if not self.pending and (left <= 0 or self._closing):
                            self._worker = None
                            return
                        self._cv.wait(left if not self.pending else None)
                    self._settle()
                with self.lock, torch.no_grad():
                    self._run()
        except BaseException as e:  # never leave callers waiting on a dead scheduler
            with self._cv:
                self._worker = None
                stranded = list(self.pending)
                self.pending.clear()
            for req in stranded:
                fail(req, RuntimeError(f"the torch engine scheduler stopped: {e!r}"))
            raise

    def _settle(self) -> None:
        """Wait (holding ``_cv``) until no request has come for ``settle_s``, at most ``settle_max_s``."""
        end = time.monotonic() + self.settle_max_s
        while not self._closing and not self._want:
            now = time.monotonic()
            quiet = now - self._last_submit
            if quiet >= self.settle_s or now >= end:
                return
            self._cv.wait(min(self.settle_s - quiet, end - now))

    def _run(self) -> None:
        """Decode batches until no row is left (admitting new requests at every step)."""
        if self.kv is not None:
            self.kv.rows = 0
        batch = Batch(kv=self.kv)
        taken: list[Request] = []
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
                fail(req, e)

    def _admit(self, batch: Batch, taken: list[Request]) -> None:
        """Take the pending requests that fit (the KV budget, ``max_rows``; a request alone always
        fits an empty batch), prefill them and add their rows to the batch."""
        with self._cv:
            if self._want:
                return
            rows = len(batch.rows)
            widest = max((_reserve(row.req) for row in batch.rows), default=0)
            new: list[Request] = []
            while self.pending:
                req = self.pending[0]
                total, wide = rows + req.params.n, max(widest, _reserve(req))
                fits = self.budget.fits(total, wide) and (self.max_rows is None or total <= self.max_rows)
                if not fits and (batch.rows or new):
                    break
                new.append(self.pending.popleft())
                rows, widest = total, wide
        if new:
            mark("admit", "", requests=len(new), rows=rows)
        fresh: list[Request] = []
        for req in new:
            if not req.future.set_running_or_notify_cancel():
                continue
            taken.append(req)
            self._start(req)
            if self.engine.prefix.reusable(req.key):
                self._prefill_one(batch, req)
            else:
                fresh.append(req)
        if not fresh:
            return
        try:
            with self.engine.lora.rows(self.engine.model, [r.adapter for r in fresh]):
                cache, logits, mask = self.engine._prefill_batch(
                    [r.key for r in fresh], [r.params.n for r in fresh]
                )
        except Exception:  # one request broke the shared forward: each alone, so only that one fails
            for req in fresh:
                self._prefill_one(batch, req)
            return
        self._join(batch, [Row(req, i) for req in fresh for i in range(req.params.n)], cache, mask, logits)

    def _start(self, req: Request) -> None:
        params = req.params
        req.key = [(t, req.tag) for t in req.prompt_ids]
        req.gen = generator(params, self.engine.device)
        req.out = new_outputs(params)
        req.live = params.n

    def _prefill_one(self, batch: Batch, req: Request) -> None:
        """Prefill one request past its cached prefix (``_prefill_rows``); an error fails it alone."""
        n, length = req.params.n, len(req.prompt_ids)
        try:
            with self.engine.lora.rows(self.engine.model, req.adapter):
                cache, logits, reuse = self.engine._prefill_rows(req.key, [0] * length, False, n)
        except Exception as e:  # this request only
            fail(req, e)
            return
        for c in req.out:
            c.cached_tokens = reuse
        ones = torch.ones(n, length, dtype=torch.long, device=self.engine.device)
        self._join(batch, [Row(req, i) for i in range(n)], cache, ones, logits)

    def _join(
        self, batch: Batch, rows: list[Row], cache: Any, mask: torch.Tensor, logits: torch.Tensor
    ) -> None:
        """Add prefilled rows (their left-padded cache and mask) to the batch: copied into its static
        KV cache (grown when they do not fit), with room for every row's tokens still to come."""
        lengths = mask.sum(dim=1).tolist()
        room = max(_room(row) for row in batch.rows + rows)
        kv = allocate(batch.kv, cache, len(batch.rows) + len(rows), mask.shape[1], room)
        kv.add(cache, mask, room)
        batch.kv = self.kv = kv
        batch.lengths = batch.lengths + lengths
        batch.logits = logits if batch.logits is None else torch.cat([batch.logits, logits])
        batch.rows += rows

    def _step(self, batch: Batch) -> None:
        """Sample every row (the plain requests' rows together, ``sample_rows``; the others request by
        request, each with its own params and generator), retire finished rows (their caches go to
        the prefix cache), then one batched forward of the rest."""
        next_tokens = [0] * len(batch.rows)
        drop: set[int] = set()
        finished: list[Request] = []
        by_request = _by_request(batch.rows)
        drawn = self._sample_plain(batch, [(r, idx) for r, idx in by_request if is_plain(r.params)])
        for req, idx in by_request:
            try:
                toks, lps, top = drawn[id(req)] if id(req) in drawn else self._sample_request(batch, req, idx)
                ended = self._take(batch, req, idx, toks, lps, top, next_tokens)
            except Exception as e:  # this request only: drop its rows, keep decoding the others
                fail(req, e)
                drop.update(idx)
                continue
            drop.update(ended)
            self._retire(batch, ended)
            req.live -= len(ended)
            if req.live == 0:
                finished.append(req)
        for req in finished:
            if not req.future.done():
                req.future.set_result(req.out)
        keep = _fill_holes(len(batch.rows), drop)
        if not keep:
            batch.rows, batch.lengths, batch.logits = [], [], None
            if batch.kv is not None:
                batch.kv.rows = 0
            mark("batch_end", "")
            return
        if drop:
            next_tokens = [next_tokens[b] for b in keep]
            self._keep_rows(batch, keep)
        self._forward(batch, next_tokens)

    def _sample_plain(self, batch: Batch, plain: list[tuple[Request, list[int]]]) -> dict[int, Drawn]:
        """The next token of every row of the plain requests in one ``sample_rows`` call: by request
        (``id``), its rows' tokens, log-probs and top log-probs."""
        if not plain:
            return {}
        assert batch.logits is not None
        device = self.engine.device
        rows = [b for _, idx in plain for b in idx]
        logits = (
            batch.logits
            if rows == list(range(len(batch.rows)))
            else batch.logits[torch.tensor(rows, device=device)]
        )
        temp_list = [req.params.temperature for req, idx in plain for _ in idx]
        temps = torch.tensor(temp_list, device=device)
        draws, offsets, at = [], [], 0
        for req, idx in plain:
            assert req.gen is not None
            offsets.append(at)
            if req.params.temperature > 0.0:
                draws.append((req.gen, at, at + len(idx)))
            at += len(idx)
        unit = all(t in (0.0, 1.0) for t in temp_list)
        tokens, lps, table = sample_rows(logits, temps, draws, self.engine.logprobs_kind, unit)
        k = max(req.params.logprobs or 0 for req, _ in plain)
        top = torch.topk(table, k, dim=-1) if k else None
        toks, lp_list = tokens.tolist(), lps.tolist()
        out: dict[int, Drawn] = {}
        for (req, idx), at in zip(plain, offsets, strict=True):
            n, want = len(idx), req.params.logprobs
            mine = (
                TopRows(top.values[at : at + n, :want], top.indices[at : at + n, :want])
                if top and want
                else None
            )
            out[id(req)] = (toks[at : at + n], lp_list[at : at + n], mine)
        return out

    def _sample_request(self, batch: Batch, req: Request, idx: list[int]) -> Drawn:
        """The next token of the request's rows ``idx`` by its own ``_sample`` (logits processors,
        truncation)."""
        assert batch.logits is not None and req.gen is not None
        params = req.params
        span = idx == list(range(idx[0], idx[0] + len(idx)))
        sel = batch.logits[idx[0] : idx[-1] + 1] if span else batch.logits[idx]
        outputs = [req.out[batch.rows[b].sample].token_ids for b in idx]
        tokens, lps, table = self.engine._sample(sel, params, req.gen, req.prompt_ids, outputs)
        top = torch.topk(table, params.logprobs, dim=-1) if params.logprobs else None
        return tokens.tolist(), lps.tolist(), top

    def _take(
        self,
        batch: Batch,
        req: Request,
        idx: list[int],
        toks: list[int],
        lps: list[float],
        top: Any,
        next_tokens: list[int],
    ) -> list[int]:
        """Append the sampled tokens to the request's completions (written to ``next_tokens`` too);
        the rows that ended."""
        params = req.params
        stop_ids = set(params.stop_token_ids)
        ended: list[int] = []
        for r, b in enumerate(idx):
            next_tokens[b] = toks[r]
            sample = batch.rows[b].sample
            c = req.out[sample]
            end = self.engine._accept(c, toks[r], lps[r], top, r, params, stop_ids)
            if end:
                ended.append(b)
            if req.listener is not None:
                req.listener(Progress(sample, c, len(c.token_ids), end))
        return ended

    def _retire(self, batch: Batch, ended: list[int]) -> None:
        """Finished rows leave their cache (left padding dropped) in the prefix cache."""
        kv = batch.kv
        assert kv is not None
        for b in ended:
            row = batch.rows[b]
            c = row.req.out[row.sample]
            row_kv = partial(kv.row, b, batch.lengths[b])
            self.engine.prefix.retire_with(row.req.key, c.token_ids, row.req.tag, row_kv)

    def _keep_rows(self, batch: Batch, keep: list[int]) -> None:
        """Only rows ``keep`` go on, new row i the old row ``keep[i]`` (``_fill_holes``: only the rows
        that fill a leaver's place are copied in the static cache); columns that are padding in
        every one of them are dropped."""
        assert batch.kv is not None
        batch.kv.keep(keep)
        batch.rows = [batch.rows[b] for b in keep]
        batch.lengths = [batch.lengths[b] for b in keep]
        batch.kv.drop_left(max(batch.lengths))

    def _forward(self, batch: Batch, next_tokens: list[int]) -> None:
        """Feed every row its sampled token: the batch's next logits (and the step's statistics)."""
        assert batch.kv is not None
        engine, rows = self.engine, len(batch.rows)
        extra = engine.stats.extra
        extra["decode_steps"] += 1
        extra["batched_steps"] += rows > 1
        extra["peak_batch_rows"] = max(extra["peak_batch_rows"], rows)
        extra["peak_batch_requests"] = max(extra["peak_batch_requests"], len({id(r.req) for r in batch.rows}))
        engine.stats.decode_tokens += rows
        kv = batch.kv
        if kv.end >= kv.width:  # never with the room ``_join`` keeps: grown rather than overrun
            kv = batch.kv = self.kv = allocate(kv, None, kv.rows, kv.end - kv.start, 1)
        with engine.lora.rows(engine.model, [row.req.adapter for row in batch.rows]):
            batch.logits = self.decode(engine.model, kv, next_tokens, batch.lengths)
        batch.lengths = [n + 1 for n in batch.lengths]


def _room(row: Row) -> int:
    """Columns the row may still write: every token it may still feed."""
    return max(1, row.req.params.max_tokens - len(row.req.out[row.sample].token_ids))


def _reserve(req: Request) -> int:
    """The positions a request's rows may come to hold: its prompt and every token it may sample."""
    return len(req.prompt_ids) + req.params.max_tokens


def _by_request(rows: list[Row]) -> list[tuple[Request, list[int]]]:
    """Every request with its batch rows in sample order (the order its seeded draws follow, as
    alone), in the order the requests first appear."""
    by_req: dict[int, tuple[Request, list[int]]] = {}
    for b, row in enumerate(rows):
        by_req.setdefault(id(row.req), (row.req, []))[1].append(b)
    for _, idx in by_req.values():
        idx.sort(key=lambda b: rows[b].sample)
    return list(by_req.values())


def _fill_holes(n: int, drop: set[int]) -> list[int]:
    """The rows of ``n`` that go on when rows ``drop`` leave, as the new order: a leaver's place
    below the new count is taken by a row that goes on from the end, the others stay put (so only
    as many rows move as leave, not every row after the first leaver)."""
    m = n - len(drop)
    tail = iter([b for b in range(m, n) if b not in drop])
    return [next(tail) if b in drop else b for b in range(m)]
