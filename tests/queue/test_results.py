"""loom.results.ResultWaiter on both result stores (Loom's SQLite store, Redis), with no worker: a second
thread stores results the way a worker's task would, through the backend's own ``store_result``."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import pytest

from gateway.pipeline import CeleryStages, StageError
from loom.results import ResultWaiter


def _store_later(app: Any, task_id: str, delay: float, value: Any, state: str = "SUCCESS") -> Any:
    def go() -> None:
        time.sleep(delay)
        app.backend.store_result(task_id, value, state)

    t = threading.Thread(target=go)
    t.start()
    return t


def test_wait_wakes_on_the_stores_signal_and_reads_every_ready_result(broker_env: Any) -> None:
    app = broker_env.app("gateway")
    ids = [f"w-{uuid.uuid4().hex}" for _ in range(3)]
    app.backend.store_result(ids[0], {"n": 0}, "SUCCESS")  # ready before the wait starts
    # no fallback reads inside the test's time: only the store's change signal can wake the waiter
    with ResultWaiter(app, poll=30.0, max_quiet=30.0) as waiter:
        got = waiter.wait(ids, timeout=5)
        assert set(got) == {ids[0]} and got[ids[0]]["result"] == {"n": 0}
        t = _store_later(app, ids[1], 0.3, {"n": 1})
        t0 = time.monotonic()
        got = waiter.wait(ids[1:], timeout=5)
        waited = time.monotonic() - t0
        t.join()
        assert set(got) == {ids[1]} and got[ids[1]]["result"] == {"n": 1}
        assert 0.25 <= waited < 2.0  # woke on the store's signal, not on a poll or the timeout
        assert waiter.wait(ids[2:], timeout=0.3) == {}  # nothing stored: the timeout


def test_stages_hand_over_results_and_raise_on_a_failed_task(broker_env: Any) -> None:
    app = broker_env.app("gateway")
    stages = CeleryStages(app)
    ok, bad = f"s-{uuid.uuid4().hex}", f"s-{uuid.uuid4().hex}"
    threads = [_store_later(app, ok, 0.1, [1, 2])]
    try:
        assert asyncio.run(stages._result(ok)) == [1, 2]
        threads.append(_store_later(app, bad, 0.1, ValueError("boom"), "FAILURE"))
        with pytest.raises(StageError, match="ValueError: boom"):
            asyncio.run(stages._result(bad))
    finally:
        for t in threads:
            t.join()
        stages.close()


def test_many_waiters_share_one_reading_thread_and_a_cancelled_one_is_forgotten(broker_env: Any) -> None:
    """200 coroutines wait on 200 tasks: one hub thread reads for them all; a waiter cancelled (its job
    was) leaves nothing behind."""
    app = broker_env.app("gateway")
    stages = CeleryStages(app)
    ids = [f"h-{uuid.uuid4().hex}" for _ in range(200)]

    async def scenario() -> list[Any]:
        waiters = [asyncio.ensure_future(stages._result(i)) for i in ids]
        await asyncio.sleep(0.2)
        hub_threads = [t for t in threading.enumerate() if t.name == "gateway-results"]
        assert len(hub_threads) == 1 and stages.hub.pending() == 200
        for n, i in enumerate(ids):
            app.backend.store_result(i, n, "SUCCESS")
        got = await asyncio.wait_for(asyncio.gather(*waiters), 30)
        never = asyncio.ensure_future(stages._result(f"never-{uuid.uuid4().hex}"))
        await asyncio.sleep(0.1)
        never.cancel()
        await asyncio.sleep(0.1)
        assert stages.hub.pending() == 0
        return got

    try:
        assert asyncio.run(scenario()) == list(range(200))
    finally:
        stages.close()
