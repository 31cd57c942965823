"""Celery tasks of the rollout service (queue ``rollout``): thin shells over the core modules.

- ``rollout.generate_group(request)``: one prompt's group per task. Publish it with the group id as
  the task id (``loom.queue.send(..., key=group_id)``): LoomTask returns a stored result instead of
  running twice, and a worker killed mid-group leaves the message unacknowledged, so the broker
  redelivers it and the group is regenerated and recorded once.
- ``rollout.load_policy(version=None, path=None, kind="full")``: load a policy version into this
  worker's engine.
The engine is a process-level singleton (``engines.get_engine``): a replica keeps its prefix cache
and its engine server across tasks. Unreachable engines are retried with backoff, then the task
fails with the typed error (``EngineUnavailable`` / ``EngineTimeout``), never hangs.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from celery import Task

from loom.queue import make_celery
from loom.schemas import PolicyVersion, RolloutRequest
from loom.settings import get_settings
from loom.store import PolicyStore
from rollout_svc.engines import get_engine, get_tokenizer
from rollout_svc.engines.base import EngineTimeout, EngineUnavailable
from rollout_svc.rollout import generate_group

celery_app = make_celery("rollout")

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None


def run(coro: Coroutine[Any, Any, T]) -> T:
    """One event loop per worker process, so async engine clients keep their connections."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(coro)


@celery_app.task(
    name="rollout.generate_group",
    bind=True,
    autoretry_for=(EngineUnavailable, EngineTimeout),
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=False,
    max_retries=3,
)
def generate_group_task(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    settings = get_settings()
    req = RolloutRequest.model_validate(request)
    if req.group_id is None:
        req = req.model_copy(update={"group_id": self.request.id})
    group = run(generate_group(req, get_engine(settings), lambda: get_tokenizer(settings), settings))
    group.meta.update(
        worker_pid=os.getpid(),
        redelivered=bool((self.request.delivery_info or {}).get("redelivered")),
        retries=int(self.request.retries or 0),
        generated_at=time.time(),
    )
    return group.model_dump(mode="json")


@celery_app.task(name="rollout.load_policy", bind=True)
def load_policy_task(
    self: Task, version: int | None = None, path: str | None = None, kind: str = "full"
) -> dict[str, Any]:
    settings = get_settings()
    if path is not None:
        policy = PolicyVersion(version=version or 0, path=path, kind=kind)  # type: ignore[arg-type]
    else:
        store = PolicyStore(settings.policy_store_path)
        found = store.latest() if version is None else store.get(version)
        if found is None:
            raise FileNotFoundError(f"no policy version {version} in {store.root}")
        policy = found
    engine = get_engine(settings)
    run(engine.load_policy(policy))
    return {"policy_version": engine.policy_version, "engine": engine.name, "pid": os.getpid()}
