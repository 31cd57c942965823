"""Background work of one gateway process: jobs and runs, each on its own thread, resumed at start.

The run loop lives in the gateway process (not in a Celery task): it is a long-lived conversation
with the queues that needs no worker slot, and its whole state is in SQLite, so a restarted gateway
picks every ``queued``/``running`` job and run up where the database says it stopped. One gateway
process per data_dir drives runs (``LOOM_GATEWAY_RUN_LOOP=false`` on extra API-only replicas).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gateway.jobs import run_job
from gateway.pipeline import Stages
from gateway.runs import RunLoop
from gateway.state import GatewayState

log = logging.getLogger("loom.gateway.manager")


class Manager:
    def __init__(self, state: GatewayState, stages: Stages, data_dir: Path, stop: threading.Event) -> None:
        self.state = state
        self.stages = stages
        self.data_dir = data_dir
        self.stop = stop
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def _spawn(self, key: str, target: object) -> None:
        with self._lock:
            t = self._threads.get(key)
            if t is not None and t.is_alive():
                return
            t = threading.Thread(target=target, name=key, daemon=True)  # type: ignore[arg-type]
            self._threads[key] = t
            t.start()

    def start_job(self, job_id: str) -> None:
        self._spawn(job_id, lambda: run_job(job_id, self.state, self.stages, self.stop))

    def start_run(self, run_id: str) -> None:
        def go() -> None:
            try:
                RunLoop(run_id, self.state, self.stages, self.data_dir, self.stop).run()
            except Exception as exc:  # a config that no longer loads (e.g. dataset) fails the run
                log.exception("run %s could not start", run_id)
                self.state.set_run(run_id, status="failed", error=f"{type(exc).__name__}: {exc}")

        self._spawn(run_id, go)

    def resume_all(self) -> tuple[list[str], list[str]]:
        jobs = self.state.jobs_with_status("queued", "running")
        runs = self.state.runs_with_status("queued", "running")
        for j in jobs:
            self.start_job(j)
        for r in runs:
            self.start_run(r)
        if jobs or runs:
            log.info("resumed %d jobs and %d runs", len(jobs), len(runs))
        return jobs, runs

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop.set()
        for t in list(self._threads.values()):
            t.join(timeout=timeout)
