"""The isolated verification pool: forked worker processes that run math-verify, shared fairly.

Why this shape (docs/security-workers.md): math-verify's timeouts are ``signal.alarm`` and work only
in a process's main thread; some inputs ignore them anyway; ``ProcessPoolExecutor`` fails every
pending future when one worker is killed. So:

- each worker is ``os.fork()``-ed from a process that already imported math-verify (7 ms start) and
  runs items one at a time in its main thread, math-verify's integer timeouts on;
- one scheduler thread owns every worker. It keeps up to ``pipeline_depth`` (2) items in a worker's
  pipe (the worker never idles while the scheduler hands a verdict over) and waits at most the running
  item's deadline; past it the scheduler SIGKILLs that worker only, answers ``timeout`` and forks a
  fresh one when there is work (the item is not retried; items queued behind it never started and are
  scheduled again); the other workers and their items are unaffected;
- a worker is recycled after ``max_items`` items or when its RSS grew by ``max_rss_growth_mb``;
  its address space is capped (``RLIMIT_AS``) so a runaway allocation fails inside it.

Fairness (one request's hostile items must not hold up another request; docs/security-workers.md):

- every ``check_many`` / ``acheck_many`` call (and every lone ``submit``) is a request with its own
  queue; a free worker takes the requests in turn (round robin), so a request never waits behind
  another one's backlog, and an idle worker is always used before a second item goes into a busy
  worker's pipe;
- an item that has run ``slow_s`` marks its worker slow: the items waiting in that worker's pipe are
  taken back (a shared mark tells the worker to skip them) and scheduled elsewhere, so one request's
  hostile items spread over the idle workers instead of queueing behind each other (its priority is
  left alone: at nice 19 a merely slowish item, starved by other processes on a loaded machine, ran
  into its deadline);
- when a worker turns slow, a spare process is forked for it (and warms up) at once, up to
  ``spare_workers`` spares, more forked on demand while other requests need one;
  while any worker is slow each serves a request that has no slow item of its own and no spare yet:
  another request's items wait for a slow item at most about ``slow_s``. A request whose own item is
  slow keeps only the regular ``workers``. Spares go once no worker is slow. More concurrently
  hostile requests than spares wait as before (the gateway's per-key quotas bound how many one user
  can send).

The worker process itself is ``reward_svc.verifier``; ``_Workers`` forks and kills them, and
``VerifierPool``'s scheduler thread decides which item runs where.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import selectors
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from loom.closing import Closing
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.verifier import NONE_TAKEN, warm_up, worker_main, write_mark

log = logging.getLogger("loom.reward.pool")


# An item queued behind the running one sits in the pipe's kernel buffer (a socket pair's, a few
# hundred KiB) until the worker reads it; a larger one would block the scheduler in send() while the
# running item may be stuck, and the scheduler is what enforces the deadlines (tested with 2 MB: the
# batch hung). Larger items are sent only to an idle worker.
PIPE_SAFE_CHARS = 8_000


def _size(item: MathItem) -> int:
    return len(item.gold) + len(item.region)


@dataclass(eq=False)
class _Request:
    """One caller's items (a ``check_many`` batch, or one ``submit``): the unit of fairness."""

    jobs: deque[_Job] = field(default_factory=deque)


@dataclass(eq=False)
class _Job:
    item: MathItem
    deadline_s: int
    request: _Request
    future: Future[Verdict] = field(default_factory=Future)
    started: bool = False  # handed to a worker once (its future is running)


@dataclass(eq=False)
class _Sent:
    seq: int
    job: _Job
    taken: bool = False  # taken back: the worker skips it, or answers it if it had started already


@dataclass(eq=False)
class _Worker:
    pid: int
    conn: Connection
    mark: mmap.mmap  # shared with the worker: it skips the items of its pipe numbered above this
    slot: int
    spare: bool
    rss0_kb: int = 0
    items: int = 0
    retire: bool = False  # due for recycling: finishes what is in its pipe, then goes
    pipe: deque[_Sent] = field(default_factory=deque)
    seq: int = 0
    started: float = 0.0  # when the item at the head of the pipe started
    slow: bool = False
    marked: bool = False  # ``mark`` names taken items (else it holds NONE_TAKEN)

    def holds(self, request: _Request) -> bool:
        return any(s.job.request is request and not s.taken for s in self.pipe)


@dataclass
class PoolStats:
    items: int = 0
    timeouts: int = 0
    crashes: int = 0
    forks: int = 0
    recycles: int = 0
    spares: int = 0  # forks of spare workers
    taken_back: int = 0  # items moved out of a slow worker's pipe


class PoolClosed(RuntimeError):
    pass


class _Workers:
    """The verifier processes: regular slots ``0..n_workers-1``, then the spare ones. Forks, kills
    and the selector over their pipes (and the pool's wake-up pipe, whose key has no data). Driven by
    the scheduler thread; the slots are read under ``lock`` by any thread (``pids``)."""

    def __init__(
        self,
        n_workers: int,
        n_spares: int,
        mem_limit_mb: int,
        stats: PoolStats,
        lock: threading.Lock,
        wake_fds: tuple[int, int],
    ) -> None:
        self.n_workers = n_workers
        self.mem_limit_mb = mem_limit_mb
        self.stats = stats
        self.lock = lock  # the pool's: it also guards the pool's inbox
        self.slots: list[_Worker | None] = [None] * (n_workers + n_spares)
        self.fork_retry_at: float | None = None
        self.wake_fds = wake_fds
        self.selector = selectors.DefaultSelector()  # the wake-up pipe and every worker's pipe
        self.selector.register(wake_fds[0], selectors.EVENT_READ)

    def live(self) -> list[_Worker]:
        return [w for w in self.slots if w is not None]

    def pids(self) -> list[int]:
        with self.lock:
            return [w.pid for w in self.slots if w is not None]

    def try_fork(self, slot: int) -> _Worker | None:
        """A fresh worker in ``slot``, or None when the system refuses a process now (the job waits;
        the scheduler tries again in a second)."""
        try:
            worker = self._fork(slot)
        except OSError as exc:
            log.warning("could not fork a verifier process: %s", exc)
            self.fork_retry_at = time.monotonic() + 1.0
            return None
        self.fork_retry_at = None
        return worker

    def _fork(self, slot: int) -> _Worker:
        parent, child = Pipe(duplex=True)
        mark = mmap.mmap(-1, mmap.PAGESIZE)
        write_mark(mark, NONE_TAKEN)
        with self.lock:
            others: list[Any] = [w.conn for w in self.live()] + list(self.wake_fds)
            pid = os.fork()
            if pid == 0:  # child
                parent.close()
                worker_main(child, others, mark, self.mem_limit_mb)
            child.close()
            spare = slot >= self.n_workers
            worker = _Worker(pid=pid, conn=parent, mark=mark, slot=slot, spare=spare)
            self.slots[slot] = worker
            self.selector.register(parent, selectors.EVENT_READ, worker)
            self.stats.forks += 1
            self.stats.spares += int(spare)
        return worker

    def kill(self, worker: _Worker) -> None:
        with self.lock:
            if self.slots[worker.slot] is worker:
                self.slots[worker.slot] = None
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(worker.pid, 0)
        except ChildProcessError:
            pass
        self.selector.unregister(worker.conn)
        worker.conn.close()
        worker.mark.close()

    def start_spares(self) -> None:
        """Fork spares as soon as a worker turns slow, not when the next request comes: they are warm
        (their own warm-up done) by the time another request needs one. One per slow worker, not every
        spare slot: forking all ``n_spares`` at each slow item (the parent blocked ~3 ms per fork, each
        child's warm-up taking a core from the regular workers, the idle ones killed again once no
        worker is slow) was what a 16-worker pool spent its scaling on; a further request that needs a
        spare still gets one forked on demand (``VerifierPool._target``)."""
        live = self.live()
        wanted = sum(w.slow for w in live) - sum(w.spare for w in live)
        for slot in range(self.n_workers, len(self.slots)):
            if wanted <= 0:
                return
            if self.slots[slot] is None:
                if self.try_fork(slot) is None:
                    return
                wanted -= 1

    def retire_idle_spares(self) -> None:
        """Idle spares go once no worker is slow (while one is, the next request may need them)."""
        live = self.live()
        if any(w.slow for w in live):
            return
        for w in live:
            if w.spare and not w.pipe:
                self.kill(w)


class VerifierPool(Closing):
    """``workers`` forked verifiers (and up to ``spare_workers`` more while some are slow) shared by
    requests in turn. Thread-safe; use ``check_many`` (blocking) or ``acheck_many`` (asyncio)."""

    def __init__(
        self,
        workers: int = 2,
        *,
        max_items: int = 300,
        max_rss_growth_mb: int = 512,
        mem_limit_mb: int = 2048,
        pipeline_depth: int = 2,
        spare_workers: int | None = None,
        slow_s: float = 0.5,
    ) -> None:
        warm_up()
        self.n_workers = max(1, workers)
        self.n_spares = self.n_workers if spare_workers is None else max(0, spare_workers)
        self.max_items = max_items
        self.max_rss_growth_kb = max_rss_growth_mb * 1024
        self.mem_limit_mb = mem_limit_mb
        self.pipeline_depth = max(1, pipeline_depth)
        self.slow_s = slow_s
        self.stats = PoolStats()
        self._inbox: deque[_Request] = deque()
        self._lock = threading.Lock()  # the inbox and the workers' slots (read by worker_pids)
        self._ready: deque[_Request] = deque()  # requests with queued jobs, in turn
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers = _Workers(
            self.n_workers, self.n_spares, mem_limit_mb, self.stats, self._lock, (self._wake_r, self._wake_w)
        )
        self._thread = threading.Thread(target=self._run, name="verifier-scheduler", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, s: Any) -> VerifierPool:
        """The pool a reward process runs (``loom.contracts.reward_settings.RewardSettings``)."""
        return cls(
            s.workers,
            max_items=s.max_items_per_worker,
            max_rss_growth_mb=s.max_rss_growth_mb,
            mem_limit_mb=s.mem_limit_mb,
            spare_workers=s.spare_workers,
            slow_s=s.slow_item_s,
        )

    # ---------------------------------------------------------------- public

    def submit(self, item: MathItem, deadline_s: int) -> Future[Verdict]:
        return self._submit([item], deadline_s)[0]

    def check_many(self, items: Sequence[MathItem], deadline_s: int) -> list[Verdict]:
        return self._batch(self._submit(items, deadline_s)).result()

    async def acheck_many(self, items: Sequence[MathItem], deadline_s: int) -> list[Verdict]:
        return await asyncio.wrap_future(self._batch(self._submit(items, deadline_s)))

    def _submit(self, items: Sequence[MathItem], deadline_s: int) -> list[Future[Verdict]]:
        request = _Request()
        jobs = [_Job(it, max(1, int(deadline_s)), request) for it in items]
        if not jobs:
            return []
        request.jobs.extend(jobs)
        with self._lock:
            if self._closed:
                raise PoolClosed("verifier pool is closed")
            self._inbox.append(request)
        self._wake()
        return [j.future for j in jobs]

    @staticmethod
    def _batch(futures: list[Future[Verdict]]) -> Future[list[Verdict]]:
        """One future for a whole batch, resolved by the scheduler when it answers the last item: the
        caller wakes once per batch, not once per item (per-item wake-ups of the waiting thread or
        event loop were CPU taken from the workers on a machine with as many cores as workers)."""
        done: Future[list[Verdict]] = Future()
        left = [len(futures)]
        lock = threading.Lock()

        def one(_: Future[Verdict]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                try:
                    done.set_result([f.result() for f in futures])
                except BaseException as e:  # a failed item fails the batch, as f.result() would
                    done.set_exception(e)

        if not futures:
            done.set_result([])
        for f in futures:
            f.add_done_callback(one)
        return done

    def worker_pids(self) -> list[int]:
        return self._workers.pids()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(timeout=10)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # full: the scheduler is waking anyway; closed: it is gone
            pass

    # ---------------------------------------------------------------- the scheduler thread

    def _run(self) -> None:
        for slot in range(self.n_workers):  # started eagerly: the first request finds them ready
            self._workers.try_fork(slot)
        try:
            while not self._closed:
                for key, _ in self._workers.selector.select(self._next_event()):
                    if key.data is None:
                        os.read(self._wake_r, 4096)
                    elif self._workers.slots[key.data.slot] is key.data:  # not killed by an earlier event
                        self._receive(key.data)
                self._admit()
                self._check_heads(time.monotonic())
                self._dispatch()
                self._workers.retire_idle_spares()
        except BaseException:  # a bug here must not leave callers waiting forever
            log.exception("verifier scheduler failed")
        self._shutdown()

    def _next_event(self) -> float | None:
        """Seconds until the next deadline or slow mark of a running item, or a fork to try again
        (None: nothing to wait for)."""
        at = self._workers.fork_retry_at if self._ready else None
        for w in self._workers.live():
            if not w.pipe:
                continue
            t = w.started + w.pipe[0].job.deadline_s
            if not w.slow:
                t = min(t, w.started + self.slow_s)
            at = t if at is None else min(at, t)
        return None if at is None else max(0.0, at - time.monotonic())

    def _admit(self) -> None:
        with self._lock:
            self._admit_locked()

    def _resolve(self, job: _Job, verdict: Verdict) -> None:
        if not job.future.done():
            job.future.set_result(verdict)

    def _requeue(self, sent: Sequence[_Sent]) -> None:
        """Put items that never started back at the head of their requests' queues, in order."""
        for s in reversed(sent):
            if s.taken or s.job.future.done():
                continue
            s.taken = True
            if not s.job.request.jobs:
                self._ready.append(s.job.request)
            s.job.request.jobs.appendleft(s.job)

    def _receive(self, worker: _Worker) -> None:
        """The answer of the item at the head of ``worker``'s pipe."""
        try:
            msg = worker.conn.recv()
        except (EOFError, OSError):
            if worker.pipe:  # died on its running item; an idle one died on nothing of ours
                head = worker.pipe.popleft()
                self._resolve(head.job, Verdict("parse_error", detail="verifier process died on this input"))
                self.stats.crashes += 1
                self._requeue(worker.pipe)
            self._workers.kill(worker)
            return
        if not worker.pipe:  # an answer to nothing: not a worker of ours any more
            self._workers.kill(worker)
            return
        now = time.monotonic()
        head = worker.pipe.popleft()
        if msg is None and not head.taken:  # cannot happen (the mark names taken items only): rerun it
            self._requeue([head])
        if msg is not None:  # None: a taken-back item, skipped
            verdict, rss_kb = msg
            self._resolve(head.job, replace(verdict, seconds=now - worker.started))
            worker.items += 1
            if worker.rss0_kb == 0:
                worker.rss0_kb = rss_kb
            if not worker.retire and (
                worker.items >= self.max_items or rss_kb - worker.rss0_kb > self.max_rss_growth_kb
            ):
                worker.retire = True
                self.stats.recycles += 1
        worker.started, worker.slow = now, False
        if worker.marked and not any(s.taken for s in worker.pipe):
            write_mark(worker.mark, NONE_TAKEN)
            worker.marked = False
        if worker.retire and not worker.pipe:
            self._workers.kill(worker)

    def _check_heads(self, now: float) -> None:
        """Kill the workers whose running item is past its deadline; mark slow the ones whose item has
        run ``slow_s`` and take back what waits in their pipes."""
        for w in self._workers.live():
            if not w.pipe:
                continue
            head = w.pipe[0]
            if now >= w.started + head.job.deadline_s:
                w.pipe.popleft()
                self._resolve(head.job, Verdict("timeout", detail=f"killed after {head.job.deadline_s} s"))
                self.stats.timeouts += 1
                self._requeue(w.pipe)
                self._workers.kill(w)  # the hard deadline: only this worker, the item is not retried
            elif not w.slow and now >= w.started + self.slow_s:
                w.slow = True
                self._workers.start_spares()
                behind = [s for s in list(w.pipe)[1:] if not s.taken]
                if behind:
                    write_mark(w.mark, head.seq)
                    w.marked = True
                    self.stats.taken_back += len(behind)
                    self._requeue(behind)

    def _holds_slow(self, request: _Request) -> bool:
        return any(w.slow and w.pipe and w.pipe[0].job.request is request for w in self._workers.live())

    def _spare_of(self, request: _Request) -> _Worker | None:
        return next((w for w in self._workers.live() if w.spare and w.holds(request)), None)

    def _target(self, request: _Request, job: _Job) -> _Worker | None:
        """Where ``job`` runs now, or None: it waits. An idle worker first (a fresh one in an empty
        regular slot), then a spare (only while a worker is slow, for a request with no slow item of
        its own and no other spare), then the shortest pipe of a worker that is not slow."""
        for slot in range(self.n_workers):
            w = self._workers.slots[slot]
            if w is None:
                return self._workers.try_fork(slot)
            if not w.pipe and not w.retire:
                return w
        live = self._workers.live()
        spare_ok = False
        if self.n_spares and any(w.slow for w in live) and not self._holds_slow(request):
            own = self._spare_of(request)
            spare_ok = True
            if own is None:
                for slot in range(self.n_workers, len(self._workers.slots)):
                    w = self._workers.slots[slot]
                    if w is None:
                        return self._workers.try_fork(slot)
                    if not w.pipe and not w.retire:
                        return w
        if _size(job.item) > PIPE_SAFE_CHARS:
            return None
        room = [
            w
            for w in live
            if w.pipe
            and len(w.pipe) < self.pipeline_depth
            and not w.slow
            and not w.retire
            and not any(s.taken for s in w.pipe)
            and (not w.spare or (spare_ok and self._spare_of(request) in (None, w)))
        ]
        return min(room, key=lambda w: len(w.pipe)) if room else None

    def _dispatch(self) -> None:
        """Hand queued items to workers, one request's item at a time in turn."""
        failures = 0
        blocked = 0
        while self._ready and blocked < len(self._ready):
            request = self._ready.popleft()
            while request.jobs and request.jobs[0].future.done():
                request.jobs.popleft()  # answered by a worker that had started it before it was taken
            if not request.jobs:
                continue
            job = request.jobs.popleft()
            if not job.started:
                job.started = True
                if not job.future.set_running_or_notify_cancel():
                    if request.jobs:
                        self._ready.appendleft(request)
                    continue
            worker = self._target(request, job)
            if worker is None:
                request.jobs.appendleft(job)
                self._ready.append(request)
                blocked += 1
                continue
            blocked = 0
            if not self._send(worker, job):
                failures += 1
                if failures > 3:  # fresh workers die at once: answer instead of looping
                    self._resolve(job, Verdict("parse_error", detail="verifier process could not start"))
                else:
                    request.jobs.appendleft(job)
            if request.jobs:
                self._ready.append(request)

    def _send(self, worker: _Worker, job: _Job) -> bool:
        if not worker.pipe:
            worker.started, worker.slow = time.monotonic(), False
        worker.seq += 1
        timeout_s = max(1, job.deadline_s - 1) if job.deadline_s > 2 else 1
        try:
            worker.conn.send((worker.seq, job.item, timeout_s))
        except OSError:  # died between items (or while running the head: its EOF answers that one)
            if worker.pipe:
                head = worker.pipe.popleft()
                self._resolve(head.job, Verdict("parse_error", detail="verifier process died on this input"))
                self.stats.crashes += 1
                self._requeue(worker.pipe)
            self._workers.kill(worker)
            return False
        worker.pipe.append(_Sent(worker.seq, job))
        self.stats.items += 1
        return True

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
            self._admit_locked()
        for w in self._workers.live():
            for s in w.pipe:
                if not s.job.future.done():
                    s.job.future.set_exception(PoolClosed("verifier pool closed"))
            self._workers.kill(w)
        for request in self._ready:
            for job in request.jobs:
                if not job.future.done():
                    if not job.started:
                        job.future.set_running_or_notify_cancel()
                    if not job.future.done():
                        job.future.set_exception(PoolClosed("verifier pool closed"))
        self._ready.clear()
        self._workers.selector.close()

    def _admit_locked(self) -> None:
        while self._inbox:
            self._ready.append(self._inbox.popleft())
