"""The batching scheduler: one thread decodes every concurrent layout-free request in one batch.

Each request is prefilled on its own (prefix cache), its rows join the running batch at the next
decode step (one left-padded batch KV cache: zero keys and values on the left, a 2D attention mask
with 0 there, explicit per-row position ids; at most ``max_rows`` rows), and every request keeps its
own sampling params and seeded generator, so a seeded request's tokens do not depend on its batch
mates (up to float rounding). Rows finish independently and leave their cache in the prefix cache.
An error in one request's prefill or sampling fails that request only; a failed batched forward
fails the requests of that batch; no caller is left waiting.

The scheduler works through its engine's model, prefix cache, ``_prefill_rows``, ``_sample`` and
``_accept`` (read at every use: a policy load swaps the model, tests wrap the methods)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Completion, Listener, Progress
from rollout_svc.engines.torch.prefix_cache import Key, drop_left, merge, pad_left
from rollout_svc.engines.torch.sampling import generator, new_outputs

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


@dataclass
class Row:
    req: Request
    sample: int  # index into req.out


@dataclass
class Batch:
    """The running decode batch: rows, their left-padded KV cache, attention mask and next logits.

    Row b holds ``lengths[b]`` real tokens: the last ``lengths[b]`` positions of the cache (pads on
    the left, mask 0). ``logits[b]`` is the distribution its next token is sampled from."""

    rows: list[Row] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None  # (rows, positions) long, 1 = real token
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

    def __init__(self, engine: TorchEngine, max_rows: int) -> None:
        self.engine = engine
        self.max_rows = max(1, max_rows)
        self.lock = threading.Lock()  # the model and the prefix cache: one user at a time
        self._cv = threading.Condition()  # guards the scheduler state below
        self.pending: deque[Request] = deque()
        self._want = 0  # threads waiting for exclusive use: the scheduler admits no new rows meanwhile
        self._worker: threading.Thread | None = None
        self.idle_s = 1.0  # the scheduler thread exits after this long without work
        self._closing = False
        _LIVE.add(self)
        for k in ("decode_steps", "batched_steps", "peak_batch_rows", "peak_batch_requests"):
            engine.stats.extra[k] = 0.0

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, listener: Listener | None = None
    ) -> Future[list[Completion]]:
        fut: Future[list[Completion]] = Future()
        req = Request(list(prompt_ids), params, fut, listener=listener)
        with self._cv:
            self.pending.append(req)
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name="loom-torch-batch")
                self._worker.start()
            self._cv.notify_all()
        return fut

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

    def _run(self) -> None:
        """Decode batches until no row is left (admitting new requests at every step)."""
        batch = Batch()
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
        with self._cv:
            if self._want:
                return
            room = self.max_rows - len(batch.rows)
            new: list[Request] = []
            while self.pending and (self.pending[0].params.n <= room or not (batch.rows or new)):
                req = self.pending.popleft()
                room -= req.params.n
                new.append(req)
        for req in new:
            if not req.future.set_running_or_notify_cancel():
                continue
            taken.append(req)
            try:
                cache, logits = self._prefill(req)
            except Exception as e:  # this request only
                fail(req, e)
                continue
            self._join(batch, req, cache, logits)

    def _prefill(self, req: Request) -> tuple[Any, torch.Tensor]:
        params, ids = req.params, req.prompt_ids
        req.key = [(t, 0) for t in ids]
        req.gen = generator(params, self.engine.device)
        req.out = new_outputs(params)
        req.live = params.n
        cache, logits, reuse = self.engine._prefill_rows(req.key, [0] * len(ids), False, params.n)
        for c in req.out:
            c.cached_tokens = reuse
        return cache, logits

    def _join(self, batch: Batch, req: Request, cache: Any, logits: torch.Tensor) -> None:
        """Add the request's prefilled rows to the batch: left-pad the shorter side, stack the rows."""
        n, length = req.params.n, len(req.prompt_ids)
        ones = torch.ones(n, length, dtype=torch.long, device=self.engine.device)
        if batch.mask is None or batch.logits is None:
            batch.cache, batch.mask, batch.lengths, batch.logits = cache, ones, [length] * n, logits
        else:
            width = batch.mask.shape[1]
            total = max(width, length)
            batch.cache = merge(batch.cache, width, cache, length)
            batch.mask = torch.cat(
                [
                    pad_left(batch.mask, total - width, 1),
                    pad_left(ones, total - length, 1),
                ]
            )
            batch.lengths = batch.lengths + [length] * n
            batch.logits = torch.cat([batch.logits, logits])
        batch.rows += [Row(req, i) for i in range(n)]

    def _step(self, batch: Batch) -> None:
        """Sample every row (each request with its own params and generator), retire finished rows
        (their caches go to the prefix cache), then one batched forward of the rest."""
        next_tokens = [0] * len(batch.rows)
        drop: set[int] = set()
        finished: list[Request] = []
        for req, idx in _by_request(batch.rows):
            try:
                ended = self._sample_request(batch, req, idx, next_tokens)
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
        keep = [b for b in range(len(batch.rows)) if b not in drop]
        if not keep:
            batch.rows, batch.cache, batch.mask, batch.lengths, batch.logits = [], None, None, [], None
            return
        if len(keep) < len(batch.rows):
            next_tokens = [next_tokens[b] for b in keep]
            self._keep_rows(batch, keep)
        self._forward(batch, next_tokens)

    def _sample_request(
        self, batch: Batch, req: Request, idx: list[int], next_tokens: list[int]
    ) -> list[int]:
        """Sample the next token of the request's rows ``idx`` (written to ``next_tokens``); the rows
        that ended."""
        assert batch.logits is not None and req.gen is not None
        params = req.params
        span = idx[-1] - idx[0] + 1 == len(idx)
        sel = batch.logits[idx[0] : idx[-1] + 1] if span else batch.logits[idx]
        outputs = [req.out[batch.rows[b].sample].token_ids for b in idx]
        tokens, lps, table = self.engine._sample(sel, params, req.gen, req.prompt_ids, outputs)
        top = torch.topk(table, params.logprobs, dim=-1) if params.logprobs else None
        toks, lp_list = tokens.tolist(), lps.tolist()
        stop_ids = set(params.stop_token_ids)
        ended: list[int] = []
        for r, b in enumerate(idx):
            next_tokens[b] = toks[r]
            sample = batch.rows[b].sample
            c = req.out[sample]
            end = self.engine._accept(c, toks[r], lp_list[r], top, r, params, stop_ids)
            if end:
                ended.append(b)
            if req.listener is not None:
                req.listener(Progress(sample, c, len(c.token_ids), end))
        return ended

    def _retire(self, batch: Batch, ended: list[int]) -> None:
        """Finished rows leave their cache (left padding dropped) in the prefix cache."""
        assert batch.mask is not None
        width = batch.mask.shape[1]
        for b in ended:
            row = batch.rows[b]
            c = row.req.out[row.sample]
            self.engine.prefix.retire(row.req.key, c.token_ids, 0, batch.cache, b, width - batch.lengths[b])

    def _keep_rows(self, batch: Batch, keep: list[int]) -> None:
        """Only rows ``keep`` go on; columns that are padding in every one of them are dropped."""
        assert batch.mask is not None
        width = batch.mask.shape[1]
        sel = torch.tensor(keep, device=self.engine.device)
        batch.cache.batch_select_indices(sel)
        batch.mask = batch.mask[sel]
        batch.rows = [batch.rows[b] for b in keep]
        batch.lengths = [batch.lengths[b] for b in keep]
        start = width - max(batch.lengths)
        if start > 0:
            batch.cache = drop_left(batch.cache, start)
            batch.mask = batch.mask[:, start:]

    def _forward(self, batch: Batch, next_tokens: list[int]) -> None:
        """Feed every row its sampled token: the batch's next logits (and the step's statistics)."""
        assert batch.mask is not None
        engine, rows = self.engine, len(batch.rows)
        extra = engine.stats.extra
        extra["decode_steps"] += 1
        extra["batched_steps"] += rows > 1
        extra["peak_batch_rows"] = max(extra["peak_batch_rows"], rows)
        extra["peak_batch_requests"] = max(extra["peak_batch_requests"], len({id(r.req) for r in batch.rows}))
        engine.stats.decode_tokens += rows
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(rows, 1)], dim=1)
        x = torch.tensor(next_tokens, device=engine.device)[:, None]
        pos = torch.tensor(batch.lengths, device=engine.device)[:, None]
        out = engine.model(
            x, attention_mask=batch.mask, position_ids=pos, past_key_values=batch.cache, use_cache=True
        )
        batch.logits = out.logits[:, -1, :].float()
        batch.lengths = [n + 1 for n in batch.lengths]


def _by_request(rows: list[Row]) -> list[tuple[Request, list[int]]]:
    """Every request with its batch rows, in the order the requests first appear."""
    by_req: dict[int, tuple[Request, list[int]]] = {}
    for b, row in enumerate(rows):
        by_req.setdefault(id(row.req), (row.req, []))[1].append(b)
    return list(by_req.values())
