"""Background work of one gateway process: jobs and runs as coroutines on ONE event loop (its own
thread), resumed at start.

The run loop lives in the gateway process (not in a Celery task): it is a long-lived conversation
with the queues that needs no worker slot, and its whole state is in SQLite, so a restarted gateway
picks every ``queued``/``running`` job and run up where the database says it stopped. One gateway
process per data_dir drives runs (``LOOM_GATEWAY_RUN_LOOP=false`` on extra API-only replicas).

A waiting job or run costs no thread: it awaits futures that the stages' result hub resolves
(gateway/pipeline.py). The threads of this process are a fixed set whatever the number of jobs: this
loop, the result hub, the stages' publishers and ``DB_THREADS`` for SQLite writes.

Cancel (``POST /v1/jobs/{id}/cancel``, ``/v1/runs/{id}/cancel``): the API marks it ``cancelled`` in
the database and calls ``cancel``: the coroutine is cancelled and the stages skip its tasks still
queued (``Stages.cancel``). A job or run driven by another gateway process on the same database is
found by ``_watch`` within ``WATCH_S``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.jobs import run_job
from gateway.pipeline import Stages
from gateway.runs import RunLoop
from gateway.state import GatewayState

log = logging.getLogger("loom.gateway.manager")

WATCH_S = 0.5  # how often the database is read for cancels made by other gateway processes
DB_THREADS = 4


class Manager:
    def __init__(self, state: GatewayState, stages: Stages, data_dir: Path, stop: threading.Event) -> None:
        self.state = state
        self.stages = stages
        self.data_dir = data_dir
        self.stop = stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------- the loop
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                # asyncio.to_thread's pool (SQLite writes, loading a run's dataset): a fixed size, not
                # asyncio's default of cores + 4
                loop.set_default_executor(ThreadPoolExecutor(DB_THREADS, thread_name_prefix="gateway-db"))
                self._thread = threading.Thread(target=loop.run_forever, name="gateway-work", daemon=True)
                self._thread.start()
                self._loop = loop
                asyncio.run_coroutine_threadsafe(self._watch(), loop)
            return self._loop

    def _call(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop())

    def active(self) -> list[str]:
        """The jobs and runs this process drives now."""
        return [k for k, t in list(self._tasks.items()) if not t.done()]

    # -------------------------------------------------------------------------------- start, cancel
    def start_job(self, job_id: str) -> None:
        self._call(self._start(job_id, lambda: run_job(job_id, self.state, self.stages)))

    def start_run(self, run_id: str) -> None:
        async def go() -> str:
            try:  # the dataset may be big (a built-in one is generated): not on the loop
                loop = await asyncio.to_thread(
                    RunLoop, run_id, self.state, self.stages, self.data_dir, self.stop
                )
            except Exception as exc:  # a config that no longer loads (e.g. dataset) fails the run
                log.exception("run %s could not start", run_id)
                error = f"{type(exc).__name__}: {exc}"
                await asyncio.to_thread(self.state.runs.finish, run_id, "failed", error=error)
                return "failed"
            return await loop.run()

        self._call(self._start(run_id, go))

    async def _start(self, key: str, work: Callable[[], Coroutine[Any, Any, str]]) -> None:
        task = self._tasks.get(key)
        if task is not None and not task.done():
            return
        self._tasks[key] = asyncio.create_task(self._drive(key, work), name=key)

    async def _drive(self, key: str, work: Callable[[], Coroutine[Any, Any, str]]) -> str:
        try:
            status = await work()
        except asyncio.CancelledError:
            raise  # a user's cancel (``_cancel`` skips the queued tasks) or the gateway stopping
        except Exception:
            log.exception("%s: unexpected error", key)
            status = "failed"
        finally:
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
        if status == "cancelled":  # the work saw the cancel in the database itself
            await self.stages.cancel(key)
        self.stages.forget(key)
        return status

    async def _cancel(self, key: str) -> None:
        task = self._tasks.get(key)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=5.0)
        skipped = await self.stages.cancel(key)
        if task is not None:
            log.info("%s cancelled (%d queued tasks skipped)", key, skipped)

    async def cancel(self, key: str) -> None:
        """Stop job or run ``key`` now if this process drives it (call after marking it cancelled)."""
        if self._loop is None:
            return
        await asyncio.wrap_future(self._call(self._cancel(key)))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            keys = self.active()
            if not keys:
                continue
            try:
                cancelled = await asyncio.to_thread(self.state.cancelled_among, keys)
            except Exception:
                log.exception("reading cancels failed")
                continue
            for key in cancelled:
                await self._cancel(key)

    # ------------------------------------------------------------------------------ start and stop
    def resume_all(self) -> tuple[list[str], list[str]]:
        jobs = self.state.jobs.with_status("queued", "running")
        runs = self.state.runs.with_status("queued", "running")
        for j in jobs:
            self.start_job(j)
        for r in runs:
            self.start_run(r)
        if jobs or runs:
            log.info("resumed %d jobs and %d runs", len(jobs), len(runs))
        return jobs, runs

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop driving (the work stays ``running`` in the database: the next start resumes it)."""
        self.stop.set()
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = [t for t in self._tasks.values() if not t.done()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout + 1)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("some jobs or runs did not stop within %.0f s", timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=timeout)
        close = getattr(self.stages, "close", None)
        if close is not None:
            close()
