"""Warm runner slots, admission control and the health check (docs/sandbox.md "Pool").

``slots`` runner threads each own a prepared ``Slot`` (uid, cgroup with its limits, stub ``/etc``):
a run only starts bwrap in it. At most ``slots + queue`` runs are admitted at once; beyond that a
submission raises ``Busy`` at once (the API answers 429 ``busy`` with Retry-After) instead of growing
an unbounded queue. A batch is admitted whole or not at all, so its runs never wait on a half-admitted
neighbour.

The health check (one thread) ends a run still going ``grace_s`` past its wall time (a runner that
stopped answering): the run is answered ``killed`` with that reason, never lost, its processes are
killed, and the slot's thread is replaced by a fresh slot so the other runs go on.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from loom.closing import Closing
from loom.contracts.sandbox import Limits, RunRequest, RunResult
from sandbox_svc.cgroups import sweep_stale
from sandbox_svc.reaper import adopt_orphans, reap_orphans, release_orphans
from sandbox_svc.runner import Slot, bwrap_path, prestart, run
from sandbox_svc.seccomp import program

log = logging.getLogger("sandbox_svc.pool")

# every slot of this process, of every pool, gets an index of its own: its uid is the base plus it
_SLOT_INDEX = itertools.count()


def default_ceiling() -> Limits:
    """The largest limits a request may ask for, where the caller gives none (the service's own are
    its settings': sandbox_svc/config.py)."""
    return Limits(
        cpu_s=60,
        wall_s=120,
        memory_mb=4096,
        processes=256,
        open_files=1024,
        output_bytes=16 << 20,
        tmp_mb=512,
    )


class Busy(Exception):
    """Every slot is running and the queue is full: retry later (HTTP 429 ``busy``)."""

    def __init__(self, in_flight: int, capacity: int, retry_after_s: float) -> None:
        super().__init__(f"{in_flight} runs in flight of {capacity}")
        self.retry_after_s = retry_after_s


@dataclass
class PoolStats:
    runs: int = 0
    refused: int = 0
    replaced: int = 0
    by_status: dict[str, int] = field(default_factory=dict)


@dataclass
class _Job:
    request: RunRequest
    future: Future[RunResult]
    started: float | None = None


class _Runner:
    """A thread owning one slot: takes jobs from the pool's queue until it is retired."""

    def __init__(self, pool: SandboxPool, slot: Slot) -> None:
        self.pool, self.slot = pool, slot
        self.job: _Job | None = None
        self.retired = False
        self.thread = threading.Thread(target=self._loop, name=f"sandbox-slot-{slot.index}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        shape = self.pool.capped(RunRequest(code=""))
        while not self.retired:
            if self.pool.prestart:
                prestart(shape, self.slot, self.pool.bwrap)  # the next run finds its sandbox set up
            job = self.pool._queue.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                self.pool._release(1)
                continue
            job.started = time.monotonic()
            self.job = job
            try:
                result = run(job.request, self.slot, self.pool.bwrap)
            except Exception as exc:  # a runner bug is this run's sandbox_error, not a lost run
                log.exception("sandbox run failed")
                result = RunResult(status="sandbox_error", detail=f"runner failed: {type(exc).__name__}")
            self.job = None
            self.pool._answer(job, result)
            shape = job.request
        if self.retired:
            self.slot.close()


class SandboxPool(Closing):
    """Thread-safe. ``submit`` / ``run_batch`` (blocking) / ``arun_batch`` (asyncio)."""

    def __init__(
        self,
        slots: int = 2,
        *,
        queue_size: int = 32,
        max_limits: Limits | None = None,
        grace_s: float = 5.0,
        uid_base: int | None = None,
        use_cgroup: bool = True,
        python: str = "/usr/bin/python3",
        bwrap: str = "",
        use_seccomp: bool = True,
        prestart: bool = True,
    ) -> None:
        self.n_slots = max(1, slots)
        self.capacity = self.n_slots + max(0, queue_size)
        self.max_limits = max_limits or default_ceiling()
        self.grace_s = grace_s
        self.bwrap = bwrap_path(bwrap)
        self.python = python
        self.prestart = prestart
        self.seccomp = program() if use_seccomp else None
        self.stats = PoolStats()
        self._tag = f"{os.getpid()}-{id(self) % 10000}"
        # each process's slots get their own uids, so NPROC and signals never cross processes
        self._uid_base = uid_base if uid_base is not None else 200_000 + (os.getpid() % 4096) * 4096
        self._use_cgroup = use_cgroup
        self._lock = threading.Lock()
        self._in_flight = 0
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        adopt_orphans()  # finished runs' namespace inits are this process's to reap (sandbox_svc/reaper.py)
        if use_cgroup:
            sweep_stale()
        self._runners = [self._new_runner() for _ in range(self.n_slots)]
        self._health = threading.Thread(target=self._check_health, name="sandbox-health", daemon=True)
        self._health.start()

    @classmethod
    def from_settings(cls, s: object) -> SandboxPool:
        """The pool of a sandbox process (``sandbox_svc.config.SandboxSettings``)."""
        return cls(
            s.slots,  # type: ignore[attr-defined]
            queue_size=s.queue,  # type: ignore[attr-defined]
            max_limits=s.max_limits(),  # type: ignore[attr-defined]
            grace_s=s.grace_s,  # type: ignore[attr-defined]
            python=s.python,  # type: ignore[attr-defined]
            bwrap=s.bwrap,  # type: ignore[attr-defined]
        )

    def _new_runner(self) -> _Runner:
        index = next(_SLOT_INDEX) % 4096
        slot = Slot.prepare(index, self._uid_base, self._tag, self._use_cgroup)
        slot.python, slot.seccomp = self.python, self.seccomp
        return _Runner(self, slot)

    # ------------------------------------------------------------------------- public

    def capped(self, req: RunRequest) -> RunRequest:
        """``req`` with each limit at most the service's maximum."""
        lim, top = req.limits, self.max_limits
        capped = {k: min(getattr(lim, k), getattr(top, k)) for k in Limits.model_fields}
        return req.model_copy(update={"limits": Limits(**capped)})

    def submit_many(self, reqs: Sequence[RunRequest]) -> list[Future[RunResult]]:
        """Admit every run or none (``Busy``); a lone batch larger than the queue is admitted when
        nothing else is in flight, so any batch within the API's limit can run."""
        n = len(reqs)
        with self._lock:
            if self._closed:
                raise RuntimeError("sandbox pool is closed")
            if self._in_flight + n > self.capacity and self._in_flight > 0:
                self.stats.refused += 1
                raise Busy(self._in_flight, self.capacity, retry_after_s=1.0)
            self._in_flight += n
        jobs = [_Job(self.capped(r), Future()) for r in reqs]
        for job in jobs:
            self._queue.put(job)
        return [j.future for j in jobs]

    def submit(self, req: RunRequest) -> Future[RunResult]:
        return self.submit_many([req])[0]

    def run_batch(self, reqs: Sequence[RunRequest]) -> list[RunResult]:
        return [f.result() for f in self.submit_many(reqs)]

    async def arun_batch(self, reqs: Sequence[RunRequest]) -> list[RunResult]:
        import asyncio

        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in self.submit_many(reqs))))

    def health(self) -> dict[str, object]:
        with self._lock:
            return {
                "bwrap": self.bwrap,
                "slots": self.n_slots,
                "busy_slots": sum(1 for r in self._runners if r.job is not None),
                "in_flight": self._in_flight,
                "capacity": self.capacity,
                "cgroup": any(r.slot.group is not None for r in self._runners),
                "seccomp": self.seccomp is not None,
                "runs": self.stats.runs,
                "refused": self.stats.refused,
                "replaced": self.stats.replaced,
                "by_status": dict(self.stats.by_status),
            }

    def slot_uids(self) -> list[int]:
        return [r.slot.uid for r in self._runners if r.slot.uid is not None]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            runners = list(self._runners)
        for r in runners:
            r.retired = True
            r.slot.stop("killed")
        for _ in runners:
            self._queue.put(None)
        for r in runners:
            r.thread.join(timeout=10)
        while True:  # runs admitted but never started
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.future.done():
                job.future.set_result(RunResult(status="killed", detail="sandbox pool closed"))
        release_orphans()

    # ------------------------------------------------------------------------- internals

    def _release(self, n: int) -> None:
        with self._lock:
            self._in_flight -= n

    def _answer(self, job: _Job, result: RunResult) -> None:
        with self._lock:
            if job.future.done():
                return  # the health check answered it already (and released it)
            self._in_flight -= 1
            self.stats.runs += 1
            self.stats.by_status[result.status] = self.stats.by_status.get(result.status, 0) + 1
            job.future.set_result(result)

    def _check_health(self) -> None:
        while not self._closed:
            time.sleep(0.25)
            reap_orphans()
            now = time.monotonic()
            with self._lock:
                runners = list(self._runners)
            for r in runners:
                job = r.job
                if job is None or job.started is None:
                    continue
                if now > job.started + job.request.limits.wall_s + self.grace_s:
                    self._replace(r, job)

    def _replace(self, runner: _Runner, job: _Job) -> None:
        """The runner is stuck past its run's wall time: answer its run, kill it, start a fresh slot."""
        log.warning("sandbox slot %d stuck past its wall time: replaced", runner.slot.index)
        runner.retired = True
        runner.slot.stop("killed")
        with self._lock:
            self.stats.replaced += 1
            if not self._closed:
                self._runners[self._runners.index(runner)] = self._new_runner()
        self._answer(
            job,
            RunResult(
                status="killed",
                detail=f"runner stopped answering {self.grace_s} s past the wall time; slot replaced",
                wall_s=time.monotonic() - (job.started or 0.0),
            ),
        )
