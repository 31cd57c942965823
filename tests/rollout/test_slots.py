"""Engine slots of a rollout worker: how many groups run on its engine and how many wait ready."""

from __future__ import annotations

import asyncio

import pytest

from loom.contracts.settings import Settings
from loom.queue import worker_argv
from rollout_svc import tasks
from rollout_svc.config import RolloutSettings, rollout_slots


@pytest.mark.parametrize(
    ("env", "rollout", "concurrency", "expected"),
    [
        ({"engine_process": False}, {}, 2, (2, 2)),  # engine in the worker: nothing ready (one GIL)
        ({}, {}, 2, (2, 4)),  # the torch engine in its own process: as many again ready
        ({"engine_url": "http://engine:8000"}, {}, 2, (2, 4)),  # engine server: as many again ready
        ({"engine": "vllm", "engine_url": "http://e:1"}, {}, None, (1, 2)),
        ({"engine_url": "http://e:1", "worker_concurrency": 2}, {}, None, (2, 4)),
        ({"engine_url": "http://e:1"}, {"concurrency": 3}, None, (3, 6)),
        ({"engine_url": "http://e:1"}, {"ready": 1}, 4, (4, 5)),
        ({}, {"ready": 2}, 1, (1, 3)),
        ({"engine_url": "http://e:1"}, {"pool": "prefork"}, 2, (2, 2)),  # a child runs one group
    ],
)
def test_rollout_slots(env: dict, rollout: dict, concurrency: int | None, expected: tuple[int, int]) -> None:
    assert rollout_slots(Settings(**env), RolloutSettings(**rollout), concurrency) == expected


def test_the_rollout_settings_are_read_from_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_ROLLOUT_CONCURRENCY", "3")
    monkeypatch.setenv("LOOM_ROLLOUT_POOL", "prefork")
    monkeypatch.setenv("LOOM_ROLLOUT_READY", "1")
    rollout = RolloutSettings()
    assert (rollout.concurrency, rollout.pool, rollout.ready) == (3, "prefork", 1)


def test_worker_argv_takes_the_roles_concurrency_and_pool() -> None:
    argv = worker_argv("reward", Settings(), 3, "threads")
    assert argv[argv.index("-c") + 1] == "3"
    assert argv[argv.index("--pool") + 1] == "threads"


@pytest.mark.parametrize(("slots", "expected_peak"), [(1, 1), (2, 2), (0, 5)])
def test_on_engine_limits_groups_on_the_engine(slots: int, expected_peak: int) -> None:
    running = peak = 0

    async def group() -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1
        return 1

    async def main() -> list[int]:
        return await asyncio.gather(*(tasks.on_engine(group()) for _ in range(5)))

    old = tasks._slots
    tasks.set_engine_slots(slots)
    try:
        assert asyncio.run(main()) == [1] * 5
    finally:
        tasks.set_engine_slots(old)
    assert peak == expected_peak
