"""Celery tasks of the sandbox service (queue ``sandbox``): thin shells over the pool.

``sandbox.run_batch`` runs a ``BatchRequest`` in this worker process's warm pool and returns its
``BatchResult``; every run has its own outcome, so one bad program never fails the task. The pool is
one per worker process, started on first use.
"""

from __future__ import annotations

import time
from typing import Any

from loom.contracts.sandbox import BatchRequest, BatchResult
from loom.contracts.tasks import SANDBOX_RUN_BATCH
from loom.queue import make_celery, task_of
from loom.runtime import Shared

celery_app = make_celery("sandbox")


def _make_sandbox() -> Any:
    from sandbox_svc.config import get_sandbox_settings
    from sandbox_svc.pool import SandboxPool

    return SandboxPool.from_settings(get_sandbox_settings())


_sandbox = Shared(_make_sandbox).get  # the worker's warm slots, shared by its task threads


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
