"""Accepted work survives a RabbitMQ crash: durable queues, persistent messages, publisher confirms.

On a private RabbitMQ node (the ``private_rabbit`` fixture: its own ports and data directory), so
that the test can SIGKILL the broker and start it again; the shared server is never touched."""

from __future__ import annotations

import time
import uuid

import pytest

from loom.contracts.tasks import ping
from loom.queue import queue_depths, send

REWARD_PING = ping("reward")

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_tasks_accepted_before_a_broker_crash_run_after_its_restart(private_rabbit, loom_worker):
    app = private_rabbit.env.app("gateway")
    keys = [f"accepted-{uuid.uuid4().hex}" for _ in range(12)]
    for key in keys:  # accepted: the broker confirmed each publish; no worker is running yet
        send(app, REWARD_PING, key=key)
    assert queue_depths(app, ("reward",)) == {"reward": len(keys)}
    app.close()

    private_rabbit.kill()  # a crash, not a clean shutdown
    private_rabbit.start()  # the same data directory
    app = private_rabbit.env.app("gateway")
    assert queue_depths(app, ("reward",)) == {"reward": len(keys)}
    loom_worker("reward", private_rabbit.env)
    values = [app.AsyncResult(key).get(timeout=60, interval=0.1) for key in keys]
    assert [v["task_id"] for v in values] == keys
    assert queue_depths(app, ("reward",)) == {"reward": 0}


def test_a_running_worker_and_producer_ride_out_a_broker_restart(private_rabbit, loom_worker):
    worker = loom_worker("reward", private_rabbit.env)
    app = private_rabbit.env.app("gateway")
    assert send(app, REWARD_PING).get(timeout=30, interval=0.1)["service"] == "reward"

    private_rabbit.kill()
    private_rabbit.start()
    # the same producer app and the same worker process reconnect by themselves
    keys = [f"after-{uuid.uuid4().hex}" for _ in range(5)]
    results = [send(app, REWARD_PING, key=key) for key in keys]
    values = [r.get(timeout=90, interval=0.1) for r in results]
    assert [v["task_id"] for v in values] == keys
    assert worker.proc.poll() is None  # it did not exit: it reconnected
    assert all(v["pid"] == worker.pid for v in values)


def test_a_threads_worker_busy_at_a_broker_crash_keeps_consuming_after_it(private_rabbit, loom_worker):
    """Two tasks run on a threads-pool worker when the broker dies. Before the fix, Celery lowered the
    prefetch at the reconnect and restored it from the finishing task's thread, which raced the main
    thread on the connection. The worker then fetched nothing until the broker dropped it again: a
    second connection loss after 30 s to 3 min, in 2 of 3 runs of this test and 2 of 5 gateway
    crash runs. Now the worker reconnects once and runs every later task on that connection (10 of 10
    runs)."""
    worker = loom_worker("reward", private_rabbit.env, concurrency=2)
    assert "(thread)" in worker.log_path.read_text()  # the reward service's default pool
    app = private_rabbit.env.app("gateway")
    running = [send(app, REWARD_PING, 3.0, key=f"busy-{uuid.uuid4().hex}") for _ in range(2)]
    deadline = time.monotonic() + 30
    while worker.log_path.read_text().count("received") < 2:  # both are on the worker's threads
        assert time.monotonic() < deadline, "the worker never received the two tasks"
        time.sleep(0.05)

    private_rabbit.kill()
    private_rabbit.start()
    for r in running:  # redelivered (their acks died with the old connection) or returned from the store
        r.get(timeout=300, interval=0.1)
    keys = [f"after-{uuid.uuid4().hex}" for _ in range(30)]
    values = [send(app, REWARD_PING, key=key).get(timeout=300, interval=0.05) for key in keys]
    assert [v["task_id"] for v in values] == keys
    log = worker.log_path.read_text()
    assert "Temporarily reducing the prefetch count" not in log
    assert log.count("Connection to broker lost") == 1, "the worker lost its connection after the restart"
    assert worker.proc.poll() is None
