"""Shared fixtures: an isolated Loom deployment on each broker, and Loom worker processes.

``broker_env`` (function scope, parametrized ``[embedded, rabbitmq]``)
    A fresh, isolated deployment for one test, as a :class:`BrokerEnv`:

    - ``embedded``: ``LOOM_BROKER_URL=embedded`` with a tmp ``LOOM_DATA_DIR`` (broker.sqlite and
      results.sqlite live there);
    - ``rabbitmq``: ``amqp://guest:guest@127.0.0.1:5672//`` with a namespace unique to this pytest
      session and test (``LOOM_QUEUE_NAMESPACE=loomtest-<session>-<n>-``), results in Redis DB 3.
      Other people run tests on the same RabbitMQ at the same time: never use un-namespaced queues.
      The namespaced queues and exchanges are deleted at teardown.
      Skipped (with the reason) only when 127.0.0.1:5672 does not accept connections.

    ``broker_env.env`` holds the ``LOOM_*`` variables (visibility timeout 3 s, so an embedded
    redelivery after ``kill -9`` takes seconds; ``LOOM_DEVICE`` from ``LOOM_TEST_DEVICE``, default
    cpu); ``broker_env.settings`` the matching ``Settings``;
    ``broker_env.app(service)`` a Celery app for the test process (closed at teardown);
    ``broker_env.process_env()`` a full environment for a subprocess;
    ``broker_env.apply(monkeypatch)`` puts the variables into ``os.environ`` of the test process and
    clears the ``get_settings`` cache (for in-process FastAPI apps built from the environment).
    Add fields with ``broker_env.extra_env`` *before* starting processes (e.g. ports).

``loom_worker`` (function scope) -> ``start(service, broker_env, concurrency=1, args=(), wait=True)``
    Starts ``loom worker <service>`` in its own session (``start_new_session``) with that env, waits
    until Celery logs ``ready.`` (fails with the log otherwise; ``wait=False`` returns at once, then
    call ``worker.wait_ready()``, to start several in parallel), and returns a :class:`Worker`
    (``node``: its Celery node name,
    ``pid``, ``log_path``, ``log()``, ``children()`` = prefork child pids, ``kill(sig)`` of the main
    process, ``kill_group()``, ``stop(grace)`` = SIGTERM then SIGKILL). Every worker is killed at
    teardown (SIGKILL of its process group and of any remaining descendant): no orphans.

``private_rabbit`` (function scope) -> :class:`PrivateRabbit`
    A RabbitMQ node of the test's own (own ports and data directory, from the installed server),
    so that it can be crashed (``kill()``: SIGKILL) and restarted (``start()``); ``.env`` is the
    BrokerEnv of Loom processes that use it. Skipped, with the reason, where the server is not
    installed or the node does not start.

``free_port()``: a free TCP port on 127.0.0.1 (bind to port 0).
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
REDIS_RESULTS_URL = "redis://127.0.0.1:6379/3"
TEST_VISIBILITY_TIMEOUT = 3.0
# how long a started process may take to be ready: every wait below ends as soon as it is, so these are
# only bounds, set for a loaded machine (several suites beside this one: imports alone take a minute)
READY_S = 180.0
SESSION_ID = uuid.uuid4().hex[:8]
_namespace_counter = itertools.count()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """tests/docker runs last: under .ci/run, Docker's install and the image build run beside the
    rest of the suite, and that layer waits for them (tests/docker/test_compose_up.py)."""
    docker = Path(__file__).parent / "docker"
    last = [i for i in items if docker in Path(str(i.fspath)).parents]
    items[:] = [i for i in items if docker not in Path(str(i.fspath)).parents] + last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class BrokerEnv:
    kind: str  # "embedded" | "rabbitmq"
    tmp: Path
    env: dict[str, str]
    extra_env: dict[str, str] = field(default_factory=dict)
    _apps: list[Any] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return self.env.get("LOOM_QUEUE_NAMESPACE", "")

    @property
    def settings(self) -> Any:
        from loom.contracts.settings import Settings

        values = {k[len("LOOM_") :].lower(): v for k, v in {**self.env, **self.extra_env}.items()}
        return Settings(**values)

    def app(self, service: str) -> Any:
        from loom.queue import make_celery

        app = make_celery(service, self.settings)
        self._apps.append(app)
        return app

    def process_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
        env.update(self.env)
        env.update(self.extra_env)
        env.setdefault("LOOM_TORCH_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def apply(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from loom.contracts.settings import get_settings

        for k in [k for k in os.environ if k.startswith("LOOM_")]:
            monkeypatch.delenv(k)
        for k, v in {**self.env, **self.extra_env}.items():
            monkeypatch.setenv(k, v)
        get_settings.cache_clear()

    def close(self) -> None:
        if self.kind == "rabbitmq" and self.namespace:
            _delete_namespace(self.namespace)
        for app in self._apps:
            app.close()


def _delete_namespace(namespace: str) -> None:
    """Remove this test's queues and exchanges from the shared RabbitMQ."""
    from kombu import Connection

    from loom.contracts.settings import SERVICES

    try:
        with Connection(RABBITMQ_URL, connect_timeout=2) as conn:
            for service in SERVICES:
                name = f"{namespace}{service}"
                for delete in ("queue_delete", "exchange_delete"):
                    channel = conn.channel()
                    try:
                        getattr(channel, delete)(name)
                    except Exception:  # missing entity closes the channel; nothing to delete
                        pass
                    finally:
                        try:
                            channel.close()
                        except Exception:
                            pass
    except Exception:
        pass


@pytest.fixture(params=["embedded", "rabbitmq"])
def broker_env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BrokerEnv]:
    kind = request.param
    data_dir = tmp_path / "loom-data"
    env = {
        "LOOM_DATA_DIR": str(data_dir),
        "LOOM_EMBEDDED_VISIBILITY_TIMEOUT": str(TEST_VISIBILITY_TIMEOUT),
        "LOOM_TORCH_THREADS": "1",
        # the workers' torch device (rollout engine, learner): LOOM_TEST_DEVICE=cuda on a GPU host
        "LOOM_DEVICE": os.environ.get("LOOM_TEST_DEVICE", "cpu"),
    }
    if kind == "embedded":
        env.update(LOOM_BROKER_URL="embedded", LOOM_RESULT_BACKEND="embedded")
    else:
        if not _reachable("127.0.0.1", 5672):
            pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672")
        namespace = f"loomtest-{SESSION_ID}-{next(_namespace_counter)}-"
        env.update(
            LOOM_BROKER_URL=RABBITMQ_URL,
            LOOM_RESULT_BACKEND=REDIS_RESULTS_URL,
            LOOM_QUEUE_NAMESPACE=namespace,
        )
    benv = BrokerEnv(kind=kind, tmp=tmp_path, env=env)
    try:
        yield benv
    finally:
        benv.close()


RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")  # runs as the calling user


class PrivateServer:
    """A server of one test's own (its port, its data directory ``root``), in its own session, so that
    the test can crash it (``kill()``: SIGKILL) and start it again on its data (``start()``). A
    subclass gives its command line, environment and readiness probe."""

    name = "server"
    start_timeout = READY_S

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        raise NotImplementedError

    def environ(self) -> dict[str, str]:
        return dict(os.environ)

    def ready(self) -> bool:
        return _reachable("127.0.0.1", self.port, 0.2)

    def start(self) -> None:
        """Start it on its data directory (a restart keeps what it had persisted); a skip with its
        log's tail when it does not come up."""
        log_path = self.root / f"{self.name}.log"
        with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                self.argv(), env=self.environ(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.ready():
                return
            time.sleep(0.2)
        tail = log_path.read_text(errors="replace")[-2000:]
        self.kill()
        pytest.skip(f"a private {self.name} did not start here: {tail}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop its process group: SIGKILL is a crash (nothing flushed after it)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        deadline = time.monotonic() + 30
        while _reachable("127.0.0.1", self.port, 0.2) and time.monotonic() < deadline:
            time.sleep(0.2)


class PrivateRabbit(PrivateServer):
    """A RabbitMQ node of this test's own; the shared server on 5672 is never touched. ``env`` is a
    :class:`BrokerEnv` whose Loom processes use it (results in Redis DB 3, as for the shared broker)."""

    name = "RabbitMQ node"
    start_timeout = READY_S

    def __init__(self, root: Path, port: int, dist_port: int, env: BrokerEnv) -> None:
        super().__init__(root, port)
        self.dist_port, self.env = dist_port, env

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def argv(self) -> list[str]:
        return [str(RABBITMQ_SERVER)]

    def environ(self) -> dict[str, str]:
        r = self.root
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("RABBITMQ_")},
            "HOME": str(r),  # the Erlang cookie
            "RABBITMQ_NODENAME": f"loomtest{self.port}@localhost",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(r / "mnesia"),
            "RABBITMQ_LOG_BASE": str(r / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(r / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(r / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(r / "advanced.config"),
            "RABBITMQ_PID_FILE": str(r / "pid"),
        }

    def ready(self) -> bool:  # the port opens before the node takes AMQP connections
        from kombu import Connection

        try:
            with Connection(self.url, connect_timeout=1) as conn:
                conn.ensure_connection(max_retries=1, timeout=1)
            return True
        except Exception:
            return False


@pytest.fixture
def private_rabbit(tmp_path: Path) -> Iterator[PrivateRabbit]:
    """A started :class:`PrivateRabbit` (skipped, with the reason, where RabbitMQ's server is not
    installed or will not start); killed and its namespace's results dropped at teardown."""
    if not RABBITMQ_SERVER.exists():
        pytest.skip(f"RabbitMQ's server is not installed here ({RABBITMQ_SERVER})")
    root = tmp_path / "rabbit"
    root.mkdir()
    (root / "enabled_plugins").write_text("[].\n")
    (root / "rabbitmq.conf").write_text("")
    port, dist_port = free_port(), free_port()
    env = {
        "LOOM_DATA_DIR": str(tmp_path / "loom-data"),
        "LOOM_TORCH_THREADS": "1",
        "LOOM_DEVICE": os.environ.get("LOOM_TEST_DEVICE", "cpu"),
        "LOOM_BROKER_URL": f"amqp://guest:guest@127.0.0.1:{port}//",
        "LOOM_RESULT_BACKEND": REDIS_RESULTS_URL,
        "LOOM_QUEUE_NAMESPACE": f"loomtest-{SESSION_ID}-{next(_namespace_counter)}-",
    }
    rabbit = PrivateRabbit(root, port, dist_port, BrokerEnv(kind="rabbitmq-private", tmp=tmp_path, env=env))
    rabbit.start()
    try:
        yield rabbit
    finally:
        rabbit.env.close()
        rabbit.kill()


class PrivateRedis(PrivateServer):
    """A redis-server of this test's own, its append-only file fsynced on every write."""

    name = "redis-server"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root)]
        return argv + ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A started :class:`PrivateRedis` (skipped, with the reason, where redis-server is missing)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    root = tmp_path / "redis"
    root.mkdir()
    redis = PrivateRedis(root, free_port())
    redis.start()
    try:
        yield redis
    finally:
        redis.kill()


@dataclass
class Worker:
    service: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    node: str = ""  # Celery node name before "@", as in the result's "hostname"

    def wait_ready(self, timeout: float = READY_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"worker {self.node} did not become ready:\n{self.log()[-4000:]}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> list[int]:
        try:
            return [c.pid for c in psutil.Process(self.pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill_group(self) -> None:
        """SIGKILL the worker, its process group and any descendant that left the group."""
        try:
            descendants = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for child in descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, grace: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group()


def start_worker(
    benv: BrokerEnv,
    service: str,
    *,
    concurrency: int = 1,
    args: tuple[str, ...] = (),
    name: str | None = None,
    ready_timeout: float = READY_S,
    wait: bool = True,
    python: str | None = None,
) -> Worker:
    """Start ``loom worker <service>`` with ``benv``'s environment and wait until it is ready
    (``python``: another interpreter than this one, e.g. a side venv's; docs/environments.md)."""
    name = name or f"{service}-{uuid.uuid4().hex[:6]}"
    log_path = benv.tmp / f"worker-{name}.log"
    argv = [python or sys.executable, "-m", "launch.cli", "worker", service, "-c", str(concurrency), *args]
    argv += ["-n", f"{name}@%h"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=benv.process_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    worker = Worker(service=service, proc=proc, log_path=log_path, node=name)
    if wait:
        worker.wait_ready(ready_timeout)
    return worker


@pytest.fixture
def loom_worker() -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def start(service: str, env: BrokerEnv, **kwargs: Any) -> Worker:
        worker = start_worker(env, service, **kwargs)
        workers.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in workers:  # the test is over: no warm shutdown to wait for
            worker.kill_group()
