"""Celery tasks of the sandbox service (queue ``sandbox``): thin shells over the pool.

``sandbox.run_batch`` runs a ``BatchRequest`` in this worker process's warm pool and returns its
``BatchResult``; every run has its own outcome, so one bad program never fails the task. The pool is
one per worker process, started on first use. ``sandbox.run_cells`` runs a ``CellsRequest``'s cells in
one fresh interpreter session of this worker (variables kept from cell to cell) and closes it: a
session lives in one process, and a queue gives each task to any worker, so a session's id never
travels on the queue (the HTTP API holds sessions across calls; docs/sandbox.md).
"""

from __future__ import annotations

import time
from typing import Any

from loom.contracts.sandbox import BatchRequest, BatchResult, CellsRequest, CellsResult, SessionOpen
from loom.contracts.tasks import SANDBOX_RUN_BATCH, SANDBOX_RUN_CELLS
from loom.queue import make_celery, task_of
from loom.runtime import Shared

celery_app = make_celery("sandbox")


def _make_sandbox() -> Any:
    from sandbox_svc.config import get_sandbox_settings
    from sandbox_svc.pool import SandboxPool

    return SandboxPool.from_settings(get_sandbox_settings())


_sandbox = Shared(_make_sandbox).get  # the worker's warm slots, shared by its task threads


def _make_sessions() -> Any:
    from sandbox_svc.config import get_sandbox_settings
    from sandbox_svc.session import SessionManager

    return SessionManager.from_settings(get_sandbox_settings())


_sessions = Shared(_make_sessions).get


@task_of(celery_app, SANDBOX_RUN_BATCH)
def run_batch_task(batch: dict[str, Any]) -> dict[str, Any]:
    """``BatchRequest`` JSON in, ``BatchResult`` JSON out. A batch larger than the pool waits in it
    (the queue's prefetch already bounds what a worker takes)."""
    from sandbox_svc.pool import Busy

    req = BatchRequest.model_validate(batch)
    pool = _sandbox()
    while True:  # the worker's other task threads hold the pool: wait for room, never refuse a task
        try:
            futures = pool.submit_many(req.runs)
            break
        except Busy:
            time.sleep(0.1)
    return BatchResult(results=[f.result() for f in futures]).model_dump(mode="json")


@task_of(celery_app, SANDBOX_RUN_CELLS)
def run_cells_task(cells: dict[str, Any]) -> dict[str, Any]:
    """``CellsRequest`` JSON in, ``CellsResult`` JSON out: one outcome per cell. A worker whose
    sessions are all open waits for one to end (never refuses a task it took)."""
    from sandbox_svc.pool import Busy

    req = CellsRequest.model_validate(cells)
    manager = _sessions()
    opening = SessionOpen(limits=req.limits, session=req.session)
    while True:
        try:
            results = manager.run_cells(opening, [c.code for c in req.cells])
            break
        except Busy:
            time.sleep(0.1)
    return CellsResult(results=results).model_dump(mode="json")
