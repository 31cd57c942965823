"""Celery tasks of the env tier (docs/environments.md): ``env.open`` on the shared ``env`` queue,
``env.step`` and ``env.close`` on this worker's own queue.

An episode's environment lives in the worker that opened it, so its steps must come back here:
the open's answer names this process's own queue (``<namespace>env.<host>.<pid>.<random>``, not
durable, deleted by the broker when this worker's connection goes), and the client sends the steps
there (``loom.queue.send(..., to=queue)``). A worker killed mid-open leaves the open unacknowledged
and the broker redelivers it to another worker; killed mid-episode, its queue goes with it, and the
episode's next step finds no one: the client's bounded wait reports ``env_lost``. Pool: ``threads``
(``loom worker env`` sets it): the episodes are this process's memory, shared by its task threads.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any

from celery.signals import celeryd_after_setup
from kombu import Exchange, Queue

from env_svc.config import get_env_settings
from env_svc.episodes import Episodes
from loom.contracts.envs import EnvStepRequest, EnvTask
from loom.contracts.settings import get_settings
from loom.contracts.tasks import ENV_CLOSE, ENV_OPEN, ENV_STEP
from loom.queue import make_celery, queue_name, task_of
from loom.runtime import Shared

celery_app = make_celery("env")
celery_app.conf.result_expires = get_env_settings().result_expires_s  # its episode reads it at once
OWN_QUEUE = f"{queue_name('env', get_settings())}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def _make_episodes() -> Episodes:
    s = get_settings()
    return Episodes(s.env_modules, s.env_idle_s, s.env_open_timeout_s, get_env_settings().step_threads)


_episodes = Shared(_make_episodes)
episodes = _episodes.get


def own_queue() -> Queue:
    ex = Exchange(OWN_QUEUE, type="direct", durable=False, auto_delete=True)
    return Queue(OWN_QUEUE, ex, routing_key=OWN_QUEUE, durable=False, auto_delete=True)


@celeryd_after_setup.connect
def _consume_own_queue(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """The worker consumes its own queue beside ``env`` (Celery's "direct queue per worker")."""
    if instance is not None and instance.app is celery_app:
        instance.app.amqp.queues.select_add(own_queue())


@task_of(celery_app, ENV_OPEN)
def open_task(task: dict[str, Any]) -> dict[str, Any]:
    return episodes().open(EnvTask.model_validate(task), OWN_QUEUE).model_dump(mode="json")


@task_of(celery_app, ENV_STEP)
def step_task(request: dict[str, Any]) -> dict[str, Any]:
    return episodes().step(EnvStepRequest.model_validate(request)).model_dump(mode="json")


@task_of(celery_app, ENV_CLOSE)
def close_task(handle: str) -> bool:
    return episodes().end(str(handle))
