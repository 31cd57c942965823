"""Accepted work survives a RabbitMQ crash: durable queues, persistent messages, publisher confirms.

On a private RabbitMQ node (the ``private_rabbit`` fixture: its own ports and data directory), so
that the test can SIGKILL the broker and start it again; the shared server is never touched."""

from __future__ import annotations

import uuid

import pytest

from loom.queue import queue_depths, send

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_tasks_accepted_before_a_broker_crash_run_after_its_restart(private_rabbit, loom_worker):
    app = private_rabbit.env.app("gateway")
    keys = [f"accepted-{uuid.uuid4().hex}" for _ in range(12)]
    for key in keys:  # accepted: the broker confirmed each publish; no worker is running yet
        send(app, "reward.ping", key=key)
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
    assert send(app, "reward.ping").get(timeout=30, interval=0.1)["service"] == "reward"

    private_rabbit.kill()
    private_rabbit.start()
    # the same producer app and the same worker process reconnect by themselves
    keys = [f"after-{uuid.uuid4().hex}" for _ in range(5)]
    results = [send(app, "reward.ping", key=key) for key in keys]
    values = [r.get(timeout=90, interval=0.1) for r in results]
    assert [v["task_id"] for v in values] == keys
    assert worker.proc.poll() is None  # it did not exit: it reconnected
    assert all(v["pid"] == worker.pid for v in values)
