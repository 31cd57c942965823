"""The isolated verification pool: forked worker processes that run math-verify.

Why this shape (shared/notes/verifier.md): math-verify's timeouts are ``signal.alarm`` and work only
in a process's main thread; some inputs ignore them anyway; ``ProcessPoolExecutor`` fails every
pending future when one worker is killed. So:

- each worker is ``os.fork()``-ed from a process that already imported math-verify (7 ms start) and
  runs items one at a time in its main thread, math-verify's integer timeouts on;
- one driver thread per worker keeps up to ``pipeline_depth`` (2) items in the worker's pipe (the
  worker never idles while the driver hands a verdict over) and waits at most the running item's
  deadline; past it the driver SIGKILLs that worker only, answers ``timeout`` and forks a fresh one
  (the item is not retried; items queued behind it never started and run on the fresh worker); the
  other workers and their items are unaffected;
- a worker is recycled after ``max_items`` items or when its RSS grew by ``max_rss_growth_mb``;
  its address space is capped (``RLIMIT_AS``) so a runaway allocation fails inside it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import resource
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from reward_svc.mathverify import Checker, MathItem, Verdict, install_guards

log = logging.getLogger("loom.reward.pool")

_PR_SET_PDEATHSIG = 1


def _page_kb() -> int:
    return os.sysconf("SC_PAGE_SIZE") // 1024


def _statm_kb() -> tuple[int, int]:
    """(virtual size, resident size) of this process in KiB."""
    with open("/proc/self/statm") as f:
        size, rss = f.read().split()[:2]
    return int(size) * _page_kb(), int(rss) * _page_kb()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # not Linux: the pipe's EOF still ends the worker
        pass


def _worker_main(conn: Connection, close: Sequence[Connection], mem_limit_mb: int) -> None:
    """Body of a forked worker. Never returns: always ``os._exit``."""
    code = 0
    try:
        for c in close:
            c.close()
        # Inherited handlers would run the parent's shutdown logic (asyncio's wakeup fd is shared).
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        vm_kb, _ = _statm_kb()
        if mem_limit_mb > 0:
            limit = vm_kb * 1024 + mem_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        install_guards()
        checker = Checker()
        while True:
            try:
                item, timeout_s = conn.recv()
            except (EOFError, OSError):
                break
            verdict = checker.check(item, timeout_s)
            conn.send((verdict, _statm_kb()[1]))
    except BaseException:
        code = 1
    finally:
        os._exit(code)


_WARM = (
    "\\frac{1}{2}",
    "0.5",
    "(1,2]",
    "\\{1,2\\}",
    "x^2+\\sqrt{3}",
    "10\\%",
    "[-2,\\infty)",
    "\\frac{\\pi}{4}",
)


def warm_up() -> None:
    """Import math-verify and run its parser on fixed, trusted strings in this (parent) process, so
    every forked worker starts with the grammar and sympy paths loaded (a cold worker pays ~0.5 s).
    Never called on model text; timeouts are off because this may run outside a main thread."""
    import math_verify.grader as mvg
    import math_verify.parser as mvp
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    shown = mvp.TIMEOUT_WARNING_SHOWN, mvg.TIMEOUT_WARNING_SHOWN
    mvp.TIMEOUT_WARNING_SHOWN = mvg.TIMEOUT_WARNING_SHOWN = True  # no "timeout disabled" warning
    try:
        parsed = [parse("\\boxed{" + s + "}", config, parsing_timeout=None) for s in _WARM]  # type: ignore[arg-type]
        verify(parsed[0], parsed[1], timeout_seconds=None)
    finally:
        mvp.TIMEOUT_WARNING_SHOWN, mvg.TIMEOUT_WARNING_SHOWN = shown


# An item queued behind the running one sits in the pipe's kernel buffer (a socket pair's, a few
# hundred KiB) until the worker reads it; a larger one would block the driver in send() while the
# running item may be stuck, and the driver is what enforces the deadline (tested with 2 MB: the
# batch hung). Larger items are sent only to an idle worker.
PIPE_SAFE_CHARS = 8_000


def _size(item: MathItem) -> int:
    return len(item.gold) + len(item.region)


@dataclass
class _Worker:
    pid: int
    conn: Connection
    rss0_kb: int
    items: int = 0
    retire: bool = False  # due for recycling: finishes what is in its pipe, then goes

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        self.conn.close()


@dataclass
class _Job:
    item: MathItem
    deadline_s: int
    future: Future[Verdict] = field(default_factory=Future)


@dataclass
class PoolStats:
    items: int = 0
    timeouts: int = 0
    crashes: int = 0
    forks: int = 0
    recycles: int = 0


class VerifierPool:
    """``workers`` forked verifiers behind one job queue. Thread-safe; use ``check_many`` (blocking)
    or ``acheck_many`` (asyncio)."""

    def __init__(
        self,
        workers: int = 2,
        *,
        max_items: int = 300,
        max_rss_growth_mb: int = 512,
        mem_limit_mb: int = 2048,
        pipeline_depth: int = 2,
    ) -> None:
        warm_up()
        self.n_workers = workers
        self.max_items = max_items
        self.max_rss_growth_kb = max_rss_growth_mb * 1024
        self.mem_limit_mb = mem_limit_mb
        self.pipeline_depth = max(1, pipeline_depth)
        self.stats = PoolStats()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[int, _Worker] = {}
        self._closed = False
        self._drivers = [
            threading.Thread(target=self._drive, name=f"verifier-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._drivers:
            t.start()

    # ---------------------------------------------------------------- public

    def submit(self, item: MathItem, deadline_s: int) -> Future[Verdict]:
        if self._closed:
            raise RuntimeError("verifier pool is closed")
        job = _Job(item, max(1, int(deadline_s)))
        self._jobs.put(job)
        return job.future

    def check_many(self, items: Sequence[MathItem], deadline_s: int) -> list[Verdict]:
        return self._batch([self.submit(it, deadline_s) for it in items]).result()

    async def acheck_many(self, items: Sequence[MathItem], deadline_s: int) -> list[Verdict]:
        return await asyncio.wrap_future(self._batch([self.submit(it, deadline_s) for it in items]))

    @staticmethod
    def _batch(futures: list[Future[Verdict]]) -> Future[list[Verdict]]:
        """One future for a whole batch, resolved by the driver that answers its last item: the caller
        wakes once per batch, not once per item (per-item wake-ups of the waiting thread or event loop
        were CPU taken from the workers on a machine with as many cores as workers)."""
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
        with self._lock:
            return list(self._live)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._drivers:
            self._jobs.put(None)
        for t in self._drivers:
            t.join(timeout=10)
        with self._lock:
            for w in list(self._live.values()):
                w.kill()
            self._live.clear()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- drivers

    def _fork(self) -> _Worker:
        parent, child = Pipe(duplex=True)
        with self._lock:
            others = [w.conn for w in self._live.values()]
            pid = os.fork()
            if pid == 0:  # child
                parent.close()
                _worker_main(child, others, self.mem_limit_mb)
            child.close()
            worker = _Worker(pid=pid, conn=parent, rss0_kb=0)
            self._live[pid] = worker
            self.stats.forks += 1
        return worker

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            self._live.pop(worker.pid, None)
        worker.kill()

    def _drive(self) -> None:
        """One worker's driver. Up to ``pipeline_depth`` items are in the worker's pipe at once, so the
        worker starts its next item the moment it answers one instead of waiting for this thread to
        wake, hand the verdict over and send another (with ~3 ms items that gap was several per cent
        of a worker's time). Only the head item runs; its deadline counts from when it started (its
        send, or the previous verdict). A killed or dead worker takes only its head item with it:
        the items queued behind it never started and go to the fresh worker."""
        worker: _Worker | None = self._fork()  # started eagerly: the first request finds it ready
        inflight: deque[_Job] = deque()
        started = 0.0
        closing = draining = False
        held: _Job | None = None  # a large item waits for an empty pipe (see PIPE_SAFE_CHARS)
        while True:
            while not draining and len(inflight) < self.pipeline_depth:
                if held is not None:
                    if inflight:
                        break
                    job, held = held, None
                else:
                    if closing:
                        break
                    try:
                        got = self._jobs.get(block=not inflight)
                    except queue.Empty:
                        break
                    if got is None:
                        closing = True
                        break
                    job = got
                    if not job.future.set_running_or_notify_cancel():
                        continue
                    if inflight and _size(job.item) > PIPE_SAFE_CHARS:
                        held = job
                        break
                if worker is None:
                    worker = self._fork()
                if not inflight:
                    started = time.monotonic()
                if not self._send(worker, job) and not inflight:
                    # the worker died between items: fork a fresh one and try once more
                    self._retire(worker)
                    worker = self._fork()
                    self._send(worker, job)
                inflight.append(job)  # a failed send with items ahead: the head's wait finds EOF
            if not inflight:
                if draining and worker is not None:
                    self._retire(worker)
                    worker, draining = None, False
                if closing and held is None:
                    break
                continue
            assert worker is not None
            head = inflight[0]
            verdict, alive = self._await_head(worker, head, started)
            now = time.monotonic()
            inflight.popleft()
            head.future.set_result(replace(verdict, seconds=now - started))
            started = now
            if not alive:  # killed (deadline) or dead: the rest start over on a fresh worker
                worker = self._fork() if inflight else None
                draining = False
                for job in inflight:
                    assert worker is not None
                    self._send(worker, job)
                continue
            draining = worker.retire  # recycle: no new items; retire once the queued ones are answered
            if draining and not inflight:
                self._retire(worker)
                worker, draining = None, False
        if worker is not None:
            self._retire(worker)

    def _send(self, worker: _Worker, job: _Job) -> bool:
        try:
            worker.conn.send((job.item, max(1, job.deadline_s - 1) if job.deadline_s > 2 else 1))
        except OSError:
            return False
        with self._lock:
            self.stats.items += 1
        return True

    def _await_head(self, worker: _Worker, job: _Job, started: float) -> tuple[Verdict, bool]:
        """The verdict of the item running in ``worker`` and whether the worker lives on. Retires
        the worker on the hard deadline or on its death; flags a recycle through ``worker.retire``."""
        if not worker.conn.poll(max(0.0, started + job.deadline_s - time.monotonic())):
            self._retire(worker)  # the hard deadline: kill only this worker, do not retry the item
            with self._lock:
                self.stats.timeouts += 1
            return Verdict("timeout", detail=f"killed after {job.deadline_s} s"), False
        try:
            verdict, rss_kb = worker.conn.recv()
        except (EOFError, OSError):
            self._retire(worker)
            with self._lock:
                self.stats.crashes += 1
            return Verdict("parse_error", detail="verifier process died on this input"), False
        worker.items += 1
        if worker.rss0_kb == 0:
            worker.rss0_kb = rss_kb
        if not worker.retire and (
            worker.items >= self.max_items or rss_kb - worker.rss0_kb > self.max_rss_growth_kb
        ):
            worker.retire = True
            with self._lock:
                self.stats.recycles += 1
        return verdict, True
