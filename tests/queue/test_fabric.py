"""The queue fabric through real `loom worker` processes, on the embedded broker and on RabbitMQ."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kombu import Exchange, Queue

from loom.contracts.tasks import ping
from loom.queue import QUEUES, queue_depths, queue_name, send

REWARD_PING = ping("reward")

pytestmark = pytest.mark.broker


def _wait_started(app: Any, task_id: str, timeout: float = 30.0) -> dict[str, Any]:
    """The STARTED meta of ``task_id`` (task_track_started): the pid and node that run it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = app.backend.get_task_meta(task_id)
        if meta.get("status") == "STARTED":
            return dict(meta["result"])
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} never started: {app.backend.get_task_meta(task_id)}")


def _succeeded(workers: list[Any], task_id: str, wait: float = 10.0) -> int:
    """How many runs of ``task_id`` the workers logged as succeeded (waits for the first log line)."""
    deadline = time.monotonic() + wait
    count = 0
    while time.monotonic() < deadline:
        count = sum(w.log().count(f"[{task_id}] succeeded") for w in workers)
        if count:
            break
        time.sleep(0.1)
    return count


def test_ping_round_trip_through_every_queue(broker_env, loom_worker):
    workers = [loom_worker(service, broker_env, wait=False) for service in QUEUES]
    for worker in workers:
        worker.wait_ready()
    app = broker_env.app("gateway")
    results = {service: send(app, ping(service)) for service in QUEUES}
    for service, result in results.items():
        value = result.get(timeout=30, interval=0.05)
        assert value["service"] == service
        # the task ran in that service's own worker: in a prefork child, or (the rollout, reward,
        # sandbox and env workers' threads pool) in the worker process itself
        owner = next(w for w in workers if w.service == service)
        threads = service in ("rollout", "reward", "sandbox", "env")
        assert value["pid"] in ([owner.pid] if threads else owner.children())
    assert queue_depths(app) == {service: 0 for service in QUEUES}


@pytest.mark.parametrize(
    ("pool", "victim"), [("prefork", "prefork_child"), ("prefork", "worker_main"), ("threads", "worker_main")]
)
def test_kill_9_mid_task_redelivers_to_another_worker_and_records_once(broker_env, loom_worker, pool, victim):
    broker_env.env["LOOM_REWARD_POOL"] = pool
    a = loom_worker("reward", broker_env, wait=False)
    b = loom_worker("reward", broker_env, wait=False)
    a.wait_ready()
    b.wait_ready()
    app = broker_env.app("reward")
    task_id = f"group-{uuid.uuid4().hex}"
    result = send(app, REWARD_PING, delay=4.0, key=task_id)
    started = _wait_started(app, task_id)
    holder, other = (a, b) if started["hostname"].startswith(a.node + "@") else (b, a)
    if victim == "prefork_child":
        assert started["pid"] in holder.children()
        os.kill(started["pid"], signal.SIGKILL)
    else:
        holder.kill()  # SIGKILL of the main process; prefork children die with it (PDEATHSIG)

    value = result.get(timeout=60, interval=0.1)
    assert value["task_id"] == task_id
    assert value["redelivered"] is True
    assert value["pid"] != started["pid"]
    if victim == "worker_main":
        assert value["hostname"] == started["hostname"].split("@", 1)[1]
        assert value["pid"] in (other.children() if pool == "prefork" else [other.pid])
    # the killed run never finished; exactly one run succeeded and its result is the recorded one
    assert _succeeded([a, b], task_id) == 1
    assert app.backend.get_task_meta(task_id)["status"] == "SUCCESS"
    assert queue_depths(app, ("reward",)) == {"reward": 0}


class _Exploit:
    """Unpickling this creates a file: proof of code execution if a worker ever unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_pickled_message_is_rejected_logged_and_never_executed(broker_env, loom_worker, tmp_path):
    worker = loom_worker("reward", broker_env)
    app = broker_env.app("reward")
    marker = tmp_path / "pwned"
    name = queue_name("reward", broker_env.settings)
    queue = Queue(name, Exchange(name, type="direct", durable=True), routing_key=name, durable=True)
    task_id = uuid.uuid4().hex
    body = pickle.dumps(_Exploit(marker))
    with app.connection_for_write() as conn:
        producer = conn.Producer()
        producer.publish(
            body,
            exchange=queue.exchange,
            routing_key=name,
            declare=[queue],
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"task": "reward.ping", "id": task_id, "lang": "py", "argsrepr": "", "kwargsrepr": ""},
            delivery_mode=2,
        )
    # a JSON task sent after it completes, so the worker has dealt with the pickled one (FIFO, prefetch 1)
    after = send(app, REWARD_PING).get(timeout=30, interval=0.05)
    assert after["service"] == "reward"
    refused = re.compile(
        r"Received invalid task message: Refusing to deserialize untrusted content of type "
        r"application/x-python-serialize[\s\S]*The message has been ignored and discarded"
    )
    deadline = time.monotonic() + 10
    while not refused.search(worker.log()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert refused.search(worker.log()), worker.log()
    assert not marker.exists()
    assert f"[{task_id}] succeeded" not in worker.log()
    assert queue_depths(app, ("reward",)) == {"reward": 0}  # rejected, not requeued


def test_task_with_a_success_result_is_not_run_again(broker_env, loom_worker):
    worker = loom_worker("reward", broker_env)
    app = broker_env.app("reward")
    task_id = f"group-{uuid.uuid4().hex}"
    app.backend.store_result(task_id, {"precomputed": True}, "SUCCESS")
    send(app, REWARD_PING, key=task_id)
    fresh = send(app, REWARD_PING).get(timeout=30, interval=0.05)  # FIFO: the first one is done too
    assert fresh["service"] == "reward"
    deadline = time.monotonic() + 10
    while f"[{task_id}] succeeded" not in worker.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"reward.ping[{task_id}] already has a result; returning it" in worker.log()
    assert app.AsyncResult(task_id).get(timeout=5) == {"precomputed": True}
