"""Engine slots of a rollout worker: how many groups run on its engine and how many wait ready."""

from __future__ import annotations

import asyncio

import pytest

from loom.contracts.settings import Settings
from loom.queue import rollout_slots, worker_argv
from rollout_svc import tasks


@pytest.mark.parametrize(
    ("env", "concurrency", "expected"),
    [
        ({"engine_process": False}, 2, (2, 2)),  # engine in the worker: nothing ready (it shares the GIL)
        ({}, 2, (2, 4)),  # the torch engine in its own process: as many again ready
        ({"engine_url": "http://engine:8000"}, 2, (2, 4)),  # engine server: as many again ready
        ({"engine": "vllm", "engine_url": "http://e:1"}, None, (1, 2)),
        ({"engine_url": "http://e:1", "rollout_concurrency": 3}, None, (3, 6)),
        ({"engine_url": "http://e:1", "rollout_ready": 1}, 4, (4, 5)),
        ({"rollout_ready": 2}, 1, (1, 3)),
        ({"engine_url": "http://e:1", "rollout_pool": "prefork"}, 2, (2, 2)),  # a child runs one group
    ],
)
def test_rollout_slots(env: dict, concurrency: int | None, expected: tuple[int, int]) -> None:
    settings = Settings(**env)
    assert rollout_slots(settings, concurrency) == expected
    argv = worker_argv("rollout", settings, concurrency)
    assert argv[argv.index("-c") + 1] == str(expected[1])


def test_reward_worker_concurrency_is_not_changed() -> None:
    argv = worker_argv("reward", Settings(engine_url="http://e:1", worker_concurrency=3))
    assert argv[argv.index("-c") + 1] == "3"


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
