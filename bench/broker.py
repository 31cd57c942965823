"""Broker and result-backend choices for the embedded default, side by side in one run.

For each (broker, result backend) pair, through a real Celery prefork worker (concurrency 1,
prefetch 1, late ack: Loom's settings from ``loom.queue.make_celery``):

- latency: sequential ``reward.ping`` round trips (publish -> worker -> result read back), ms;
- throughput: ``--burst`` pings published at once, then all results read, tasks/s;
- kill -9: a ``ping(delay=3)`` is started, the worker (main process and children) is SIGKILLed,
  a fresh worker is started: does the task still complete (and how long after the kill)?

Run: ``loom bench broker`` (or ``.venv/bin/python bench/broker.py``). RabbitMQ+Redis is included
when 127.0.0.1:5672 answers (namespaced queues, deleted afterwards).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.settings import Settings  # noqa: E402
from loom.contracts.tasks import ping  # noqa: E402
from loom.queue import make_celery, queue_name, send, worker_argv  # noqa: E402

REWARD_PING = ping("reward")
VISIBILITY_TIMEOUT = 3.0
POLL = 0.05  # polling interval of every polling transport (same for all, so the comparison is fair)
RESULT_POLL = 0.01  # result.get(interval=...) for polling result backends

CONFIGS: dict[str, tuple[str, str]] = {
    # name: (broker, result backend); {d} = a fresh directory per configuration
    "loomsql + loom sqlite (default)": ("embedded", "embedded"),
    "loomsql + db+sqlite": ("embedded", "db+sqlite:///{d}/results-sqla.sqlite"),
    "loomsql + file://": ("embedded", "file://{d}/results"),
    "filesystem:// + file://": ("filesystem://", "file://{d}/results"),
    "sqla+sqlite + db+sqlite": ("sqla+sqlite:///{d}/kombu.sqlite", "db+sqlite:///{d}/results-sqla.sqlite"),
    "RabbitMQ + Redis": ("amqp://guest:guest@127.0.0.1:5672//", "redis://127.0.0.1:6379/3"),
}


def settings_for(name: str, d: Path, namespace: str) -> Settings:
    broker, backend = CONFIGS[name]
    return Settings(
        data_dir=d,
        broker_url=broker.format(d=d),
        result_backend=backend.format(d=d),
        queue_namespace=namespace,
        embedded_visibility_timeout=VISIBILITY_TIMEOUT,
    )


def app_for(name: str, d: Path, namespace: str) -> Any:
    settings = settings_for(name, d, namespace)
    (d / "results").mkdir(parents=True, exist_ok=True)
    app = make_celery("reward", settings)
    options = dict(app.conf.broker_transport_options or {})
    if not settings.broker_url.startswith("amqp"):
        options["polling_interval"] = POLL
    if settings.broker_url.startswith("sqla+"):
        # kombu's sqlalchemy transport hands every transport option to create_engine(): set the
        # polling interval on the class instead, and it has no visibility timeout at all.
        from kombu.transport.sqlalchemy import Transport as SqlaTransport

        SqlaTransport.polling_interval = POLL
        options = {}
    if settings.broker_url.startswith("filesystem"):
        (d / "fs").mkdir(exist_ok=True)
        options.update(
            data_folder_in=str(d / "fs"),
            data_folder_out=str(d / "fs"),
            control_folder=str(d / "control"),  # kombu defaults it to ./control
            store_processed=False,
        )
    app.conf.broker_transport_options = options
    return app


def worker_main(name: str, d: Path, namespace: str, node: str) -> None:
    app = app_for(name, d, namespace)
    argv = worker_argv("reward", settings_for(name, d, namespace), 1, "threads")
    app.worker_main([*argv, "-n", f"{node}@%h"])


class Worker:
    def __init__(self, name: str, d: Path, namespace: str) -> None:
        self.node = f"bench-{uuid.uuid4().hex[:6]}"
        self.log_path = d / f"{self.node}.log"
        cmd = [sys.executable, __file__, "--worker", name, "--dir", str(d), "--namespace", namespace]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, "--node", self.node],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "LOOM_TORCH_THREADS": "1"},
            )
        deadline = time.monotonic() + 60
        while " ready." not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(self.log_path.read_text(errors="replace")[-3000:])
            time.sleep(0.05)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def latency_ms(app: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        send(app, REWARD_PING).get(timeout=30, interval=RESULT_POLL)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def throughput(app: Any, n: int) -> float:
    t0 = time.perf_counter()
    results = [send(app, REWARD_PING) for _ in range(n)]
    for r in results:
        r.get(timeout=120, interval=RESULT_POLL)
    return n / (time.perf_counter() - t0)


def survives_kill(app: Any, name: str, d: Path, namespace: str, worker: Worker) -> tuple[bool, float]:
    task_id = uuid.uuid4().hex
    result = send(app, REWARD_PING, delay=3.0, key=task_id)
    deadline = time.monotonic() + 30
    while app.backend.get_task_meta(task_id).get("status") != "STARTED":
        if time.monotonic() > deadline:
            return False, float("nan")
        time.sleep(0.02)
    worker.kill()
    t_kill = time.perf_counter()
    fresh = Worker(name, d, namespace)
    try:
        result.get(timeout=VISIBILITY_TIMEOUT + 20, interval=RESULT_POLL)
        return True, time.perf_counter() - t_kill
    except Exception:
        return False, float("nan")
    finally:
        fresh.kill()


def rabbitmq_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            return True
    except OSError:
        return False


def delete_rabbitmq_queue(namespace: str) -> None:
    from kombu import Connection

    with Connection("amqp://guest:guest@127.0.0.1:5672//") as conn:
        for delete in ("queue_delete", "exchange_delete"):
            try:
                ch = conn.channel()
                getattr(ch, delete)(queue_name("reward", Settings(queue_namespace=namespace)))
                ch.close()
            except Exception:
                pass


def run_one(name: str, n_latency: int, burst: int) -> dict[str, Any]:
    d = Path(tempfile.mkdtemp(prefix="loom-bench-"))
    namespace = f"loombench-{uuid.uuid4().hex[:8]}-" if CONFIGS[name][0].startswith("amqp") else ""
    try:
        app = app_for(name, d, namespace)
        worker = Worker(name, d, namespace)
        try:
            latency_ms(app, 3)  # warm up connections
            lat = latency_ms(app, n_latency)
            tput = throughput(app, burst)
            ok, after = survives_kill(app, name, d, namespace, worker)
        finally:
            worker.kill()
        app.close()
        return {
            "p50": statistics.median(lat),
            "p90": statistics.quantiles(lat, n=10)[-1],
            "tput": tput,
            "kill": ok,
            "after": after,
        }
    finally:
        if namespace:
            delete_rabbitmq_queue(namespace)
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency-n", type=int, default=30)
    p.add_argument("--burst", type=int, default=200)
    p.add_argument("--only", default="", help="substring of the configurations to run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--namespace", default="", help=argparse.SUPPRESS)
    p.add_argument("--node", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker, Path(args.dir), args.namespace, args.node)
        return
    names = [n for n in CONFIGS if args.only in n and (rabbitmq_up() or not CONFIGS[n][0].startswith("amqp"))]
    rows = {}
    for name in names:
        rows[name] = run_one(name, args.latency_n, args.burst)
        print(f"  done: {name}: {rows[name]}", file=sys.stderr, flush=True)
    base = rows.get("loomsql + loom sqlite (default)")
    print(
        f"\nping through a real prefork worker (c=1, prefetch 1, late ack); {args.latency_n} sequential, "
        f"burst {args.burst}; cpu={os.cpu_count()}"
    )
    header = (
        f"{'broker + result backend':32} {'p50 ms':>8} {'p90 ms':>8} {'tasks/s':>8} {'x default':>9}  kill -9"
    )
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        ratio = r["tput"] / base["tput"] if base else float("nan")
        kill = f"completed {r['after']:.1f}s after kill" if r["kill"] else "LOST (never completed)"
        print(f"{name:32} {r['p50']:8.1f} {r['p90']:8.1f} {r['tput']:8.1f} {ratio:9.2f}  {kill}")


if __name__ == "__main__":
    main()
