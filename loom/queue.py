"""The queue fabric: one Celery app factory used by every service.

Reliability choices (docs/operations.md and docs/architecture.md "The unit of work"):
- one durable queue per service, routed by task-name prefix (``reward.*`` -> ``reward``);
- JSON only: pickle is refused when publishing and when consuming;
- late acknowledgement + reject-on-worker-lost + prefetch 1: a message is acknowledged only after
  its task finished, so a killed worker's message is redelivered;
- persistent messages and publisher confirms on RabbitMQ;
- soft and hard time limits per task;
- results keyed by an idempotency key (the task id): a redelivered task whose key already has a
  successful result returns that result instead of running again;
- no prefetch reduction after a broker reconnect on the threads pool (``_prefetch_reduction_by_pool``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

from celery import Celery, Task
from celery.concurrency import get_implementation
from celery.signals import worker_init
from kombu import Exchange, Queue
from pydantic import BaseModel

from loom.contracts.settings import SERVICES, Settings, get_settings
from loom.contracts.tasks import TaskDef, ping

log = logging.getLogger("loom.queue")
F = TypeVar("F", bound=Callable[..., Any])

QUEUES: tuple[str, ...] = SERVICES  # gateway, rollout, reward, reflect, learner

EMBEDDED_SCHEME = "loomsql"
EMBEDDED_TRANSPORT = "loom.embedded_broker:Transport"


def _register_embedded_transport() -> None:
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault(EMBEDDED_SCHEME, EMBEDDED_TRANSPORT)


def broker_url(settings: Settings) -> str:
    if settings.broker_url == "embedded":
        path = Path(settings.data_dir).resolve() / "broker.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"{EMBEDDED_SCHEME}:///{path}"
    return settings.broker_url


def result_backend_url(settings: Settings) -> str:
    if settings.result_backend == "embedded":
        from loom.embedded_results import backend_url

        path = Path(settings.data_dir).resolve() / "results.sqlite"
        path.parent.mkdir(parents=True, exist_ok=True)
        return backend_url(str(path))  # the backend puts the file in WAL mode when it opens it
    url = settings.result_backend
    if url.split("://", 1)[0] in ("redis", "rediss"):
        from loom.redis_results import BACKEND_CLASS

        return f"{BACKEND_CLASS}+{url}"  # one round trip per state change (loom/redis_results.py)
    return url


def queue_name(service: str, settings: Settings) -> str:
    """The broker name of ``service``'s queue (and exchange): ``LOOM_QUEUE_NAMESPACE`` + service."""
    return f"{settings.queue_namespace}{service}"


def _refuse_pickle() -> None:
    """Unregister pickle from kombu so nothing in a Loom process can publish it (consume: accept_content)."""
    from kombu.serialization import registry

    try:
        registry.unregister("pickle")
    except Exception:  # already unregistered
        pass


def is_amqp(url: str) -> bool:
    return url.split(":", 1)[0] in ("amqp", "amqps", "pyamqp")


class LoomTask(Task):
    """Base task: late ack, requeue on a lost worker, idempotent by task id."""

    acks_late = True
    reject_on_worker_lost = True
    typing = True
    # Celery reprs every return value for its success log line, whatever the log level: 1024 chars of a
    # rollout group took 0.3 ms per task, 128 take 0.07 ms (worker CPU per group -0.5 ms measured)
    resultrepr_maxsize = 128

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task_id = self.request.id
        if task_id and not self.request.is_eager:
            # the STARTED store just read the key (loom.redis_results) when the backend says so
            started_found = getattr(self.backend, "started_found", None)
            known, meta = started_found(task_id) if started_found is not None else (False, None)
            if not known:
                meta = self.backend.get_task_meta(task_id)
            if meta is not None and meta.get("status") == "SUCCESS":
                log.info("task %s[%s] already has a result; returning it", self.name, task_id)
                return meta.get("result")
        return super().__call__(*args, **kwargs)


def make_celery(service: str, settings: Settings | None = None) -> Celery:
    """The Celery app of ``service`` (one of QUEUES). Every service builds its app here."""
    if service not in QUEUES:
        raise ValueError(f"unknown service {service!r}; expected one of {QUEUES}")
    settings = settings or get_settings()
    _register_embedded_transport()
    _refuse_pickle()
    broker = broker_url(settings)
    names = {q: queue_name(q, settings) for q in QUEUES}
    app = Celery(f"loom.{service}", broker=broker, backend=result_backend_url(settings), task_cls=LoomTask)

    transport_options: dict[str, Any] = {}
    if is_amqp(broker):
        transport_options["confirm_publish"] = True
    else:
        transport_options["visibility_timeout"] = settings.embedded_visibility_timeout

    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        task_default_delivery_mode="persistent",
        task_default_queue=names[service],
        task_default_exchange=names[service],
        task_default_routing_key=names[service],
        task_queues=[
            Queue(n, Exchange(n, type="direct", durable=True), routing_key=n, durable=True)
            for n in names.values()
        ],
        task_routes={f"{q}.*": {"queue": n, "routing_key": n, "exchange": n} for q, n in names.items()},
        task_create_missing_queues=False,
        task_soft_time_limit=settings.task_soft_time_limit,
        task_time_limit=settings.task_time_limit,
        task_track_started=True,
        # not extended: extended results copy the task's arguments (a whole group, ~0.5 MB for 256
        # long answers) into the STARTED and SUCCESS records, and the idempotency check reads them
        # back: +28 % on a 256-item reward batch over RabbitMQ + Redis (bench/reward.py)
        result_extended=False,
        result_expires=7 * 24 * 3600,
        broker_transport_options=transport_options,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_max_tasks_per_child=settings.worker_max_tasks_per_child,
        worker_max_memory_per_child=settings.worker_max_memory_per_child_kb,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        enable_utc=True,
        loom_queue_names=names,
    )
    _register_common_tasks(app, service)
    return app


def _register_common_tasks(app: Celery, service: str) -> None:
    @task_of(app, ping(service), bind=True)
    def liveness(self: Task, delay: float = 0.0) -> dict[str, Any]:
        """Liveness round trip through this service's queue (``delay`` <= 60 s simulates work)."""
        if delay:
            time.sleep(min(float(delay), 60.0))
        return {
            "service": service,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "task_id": self.request.id,
            "redelivered": bool((self.request.delivery_info or {}).get("redelivered")),
        }


@worker_init.connect
def _prefetch_reduction_by_pool(sender: Any = None, **_: Any) -> None:
    """Turn off Celery's prefetch reduction after a reconnect in a threads-pool worker.

    After a broker reconnect with tasks still running, Celery lowers the prefetch count and restores
    it as those tasks are acknowledged. The restoring ``basic.qos`` runs in the thread that finished
    the task and waits for the broker's reply on the connection that the main thread reads too. The
    two threads then read each other's frames: the worker either blocks in that wait or fails on a
    corrupted frame ("Received frame_end 0x00 while expecting 0xce"). Either way it takes no task and
    sends no heartbeat until the broker drops the connection: 30 s to 3 min, in 2 of 5 runs of the
    gateway's broker-crash job test (tests/queue/test_broker_restart.py checks it). Prefork and solo
    workers run these callbacks on the main thread, so they keep the reduction. Without it, a threads
    worker fetches up to its full prefetch at the reconnect; with late acks that is at most one
    message per slot waiting in its buffer, never a lost one.
    """
    pool = getattr(sender, "pool_cls", None)
    if pool is not None and get_implementation(pool).__module__ == "celery.concurrency.thread":
        sender.app.conf.worker_enable_prefetch_count_reduction = False


def wire(value: Any) -> Any:
    """A task argument as the JSON the queue carries (a contract model dumped, anything else as is)."""
    return value.model_dump(mode="json") if isinstance(value, BaseModel) else value


def send(
    app: Celery, task: TaskDef, *args: Any, key: str | None = None, to: str | None = None, **kwargs: Any
) -> Any:
    """Publish ``task`` (a row of the task table, loom/contracts/tasks.py); ``key`` is its idempotency
    key (becomes the task id and result key). Contract models among the arguments go as their JSON.
    ``to``: the broker name of one worker's own queue instead of the service's (an env worker holding
    an episode, docs/environments.md), published through the default exchange and declared by nobody
    but that worker: once it is gone the message is dropped, and its sender's bounded wait says so."""
    route: dict[str, Any] = {}
    if to is not None:
        route = {"queue": Queue(to, no_declare=True), "exchange": "", "routing_key": to, "declare": []}
    return app.send_task(
        task.name,
        args=[wire(a) for a in args],
        kwargs={k: wire(v) for k, v in kwargs.items()},
        task_id=key,
        **route,
    )


def task_of(app: Celery, task: TaskDef, **options: Any) -> Callable[[F], Any]:
    """Register the decorated function as ``task``'s worker on ``app`` (Celery options as for
    ``app.task``): the one place a worker names its task."""
    return cast(Callable[[F], Any], app.task(name=task.name, **options))


def queue_depths(app: Celery, queues: tuple[str, ...] = QUEUES) -> dict[str, int | None]:
    """Messages waiting in each queue, by service name (None where the broker would not say)."""
    names: dict[str, str] = app.conf.get("loom_queue_names") or {}
    depths: dict[str, int | None] = {}
    with app.connection_for_read() as conn:
        conn.ensure_connection(max_retries=1, timeout=2)
        channel = conn.default_channel
        for q in queues:
            try:
                ok = channel.queue_declare(queue=names.get(q, q), passive=True)
                depths[q] = int(ok.message_count)
            except Exception:  # a missing queue closes amqp channels; reopen
                depths[q] = None
                channel = conn.channel()
    return depths


def check_broker(app: Celery, timeout: float = 2.0) -> tuple[bool, str]:
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout)
        return True, "ok"
    except Exception as exc:
        return False, f"{type(exc).__name__}: {exc}"


def worker_argv(service: str, settings: Settings, concurrency: int, pool: str = "prefork") -> list[str]:
    """The ``celery worker`` arguments of ``service``: its queue, ``concurrency`` tasks at once on
    ``pool``. The role decides both (its own settings: ``launch/cli.py`` ``worker_main``)."""
    return [
        "worker",
        "-Q",
        queue_name(service, settings),
        "-n",
        f"{service}-{os.getpid()}@{socket.gethostname()}",
        "-c",
        str(concurrency),
        "--pool",
        pool,
        "-l",
        "INFO",
        "--without-gossip",
        "--without-mingle",
    ]
