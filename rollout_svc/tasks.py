"""Celery tasks of the rollout service (queue ``rollout``): thin shells over the core modules.

- ``rollout.generate_group(request)``: one prompt's group per task. Publish it with the group id as
  the task id (``loom.queue.send(..., key=group_id)``): LoomTask returns a stored result instead of
  running twice, and a worker killed mid-group leaves the message unacknowledged, so the broker
  redelivers it and the group is regenerated and recorded once.
- ``rollout.load_policy(version=None, path=None, kind="full")``: load a policy version of the store
  into this worker's engine (``rollout.stored_policy``: 0 is the base model, a path must be a version
  directory of the store).
Pool: ``threads`` by default (``LOOM_ROLLOUT_POOL``): a task waits on its engine (an HTTP server, or
the torch engine's scheduler thread, in its own process by default), so a thread per task does the
same work without the prefork pool's two process hops per task (measured: the gap between
consecutive groups of one worker ~7 ms with prefork, ~3 ms with threads); a killed worker is one
process, and its unacknowledged message is redelivered as with prefork. Celery's task time limits do
not apply to the threads pool: engine calls carry their own timeouts (``LOOM_ENGINE_TIMEOUT_S``),
attention-scorer calls theirs (``LOOM_ATTENTION_TIMEOUT_S``), and a whole group is abandoned past
``LOOM_ROLLOUT_GROUP_TIMEOUT_S`` (``GroupTimeout``, not retried), which frees its slot.
The engine is a process-level singleton (``engines.get_engine``): a replica keeps its prefix cache
and its engine server across tasks. Unreachable engines are retried with backoff, then the task
fails with the typed error (``EngineUnavailable`` / ``EngineTimeout``), never hangs. Bad input fails
the task at once, typed and never retried: ``ModeError``, ``InvalidPrompt`` (a token id outside the
vocabulary, a prompt longer than the context), ``PolicyLoadError``, any ``EngineRequestError``.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
from collections.abc import Coroutine
from typing import Any, TypeVar

from celery import Task

from loom.contracts.settings import get_settings
from loom.contracts.tasks import GENERATE_GROUP, LOAD_POLICY
from loom.contracts.wire import RolloutRequest
from loom.queue import make_celery, task_of
from loom.timeline import mark
from rollout_svc.config import get_rollout_settings
from rollout_svc.engines import get_engine, get_tokenizer
from rollout_svc.engines.base import EngineTimeout, EngineUnavailable
from rollout_svc.rollout import generate_group, loop_local, stored_policy

celery_app = make_celery("rollout")

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0
_loop_lock = threading.Lock()


_slots = 0  # groups on the engine at once (0: no limit here); set by ``loom worker rollout``
_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def set_engine_slots(n: int) -> None:
    """At most ``n`` groups of this process on its engine at once (``loom.queue.rollout_slots``): a
    threads pool larger than that holds the extra tasks here, received, validated and marked started,
    until a slot frees."""
    global _slots
    _slots = max(0, int(n))


async def on_engine(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` holding one of the process's engine slots (0 slots set: no limit)."""
    if _slots <= 0:
        return await coro
    async with loop_local(_gates, lambda: asyncio.Semaphore(_slots)):
        return await coro


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on this process's one event loop, which lives in its own thread: async engine
    clients keep their connections across tasks, and with the threads pool (``LOOM_ROLLOUT_POOL``,
    the default) concurrent tasks share the loop, so the torch engine batches their requests."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop.is_closed() or _loop_pid != os.getpid():  # a forked child starts anew
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="rollout-loop", daemon=True).start()
        loop = _loop
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


@task_of(
    celery_app,
    GENERATE_GROUP,
    bind=True,
    autoretry_for=(EngineUnavailable, EngineTimeout),
    retry_backoff=1,
    retry_backoff_max=30,
    retry_jitter=False,
    max_retries=3,
)
def generate_group_task(self: Task, request: dict[str, Any]) -> dict[str, Any]:
    mark("task_start", self.request.id or "")
    settings, limit = get_settings(), get_rollout_settings().group_timeout_s
    req = RolloutRequest.model_validate(request)
    if req.group_id is None:
        req = req.model_copy(update={"group_id": self.request.id})
    engine = get_engine(settings)
    mark("engine_call", self.request.id or "")
    group = run(
        on_engine(
            generate_group(req, engine, lambda: get_tokenizer(settings), settings, group_timeout_s=limit)
        )
    )
    mark("engine_done", self.request.id or "")
    group.meta.update(
        worker_pid=os.getpid(),
        redelivered=bool((self.request.delivery_info or {}).get("redelivered")),
        retries=int(self.request.retries or 0),
        generated_at=time.time(),
    )
    out = group.model_dump(mode="json")
    mark("task_end", self.request.id or "")
    return out


@task_of(celery_app, LOAD_POLICY, bind=True)
def load_policy_task(
    self: Task, version: int | None = None, path: str | None = None, kind: str = "full"
) -> dict[str, Any]:
    settings = get_settings()
    policy = stored_policy(settings, version, path)  # as the API's /v1/policy: store versions only
    engine = get_engine(settings)
    run(engine.load_policy(policy))
    return {"policy_version": engine.policy_version, "engine": engine.name, "pid": os.getpid()}
