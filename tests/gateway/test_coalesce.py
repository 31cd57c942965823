"""The gateway's coalescing (gateway/pipeline.py ``Coalescer``, issue 34's fixed costs): groups scored
together share one reward task (each result still under its own key), groups stored together share
one commit, and a stream is woken by its job's commits."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.pipeline import SCORE, SCORE_MANY, CeleryStages, Coalescer


class Recorder:
    """A flush that records its batches; ``hold`` keeps a flush open until set."""

    def __init__(self, fail: set[int] | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail = fail or set()
        self.hold: asyncio.Event | None = None

    async def __call__(self, items: list[int]) -> list[BaseException | None]:
        self.batches.append(list(items))
        if self.hold is not None:
            await self.hold.wait()
        return [ValueError(f"item {i}") if i in self.fail else None for i in items]


def test_items_handed_in_one_turn_go_out_in_one_flush_and_each_caller_gets_its_outcome() -> None:
    rec = Recorder(fail={3})

    async def scenario() -> list[Any]:
        c: Coalescer[int] = Coalescer(rec)
        return await asyncio.gather(*(c.add(i) for i in range(6)), return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert rec.batches == [[0, 1, 2, 3, 4, 5]]
    assert [o is None for o in outcomes] == [True, True, True, False, True, True]
    assert isinstance(outcomes[3], ValueError) and str(outcomes[3]) == "item 3"


def test_items_that_come_during_a_flush_go_out_in_the_next_one_never_two_at_once() -> None:
    rec = Recorder()

    async def scenario() -> None:
        c: Coalescer[int] = Coalescer(rec)
        rec.hold = asyncio.Event()
        first = asyncio.ensure_future(c.add(0))
        await asyncio.sleep(0.05)  # the first flush runs (held)
        later = [asyncio.ensure_future(c.add(i)) for i in (1, 2)]
        await asyncio.sleep(0.05)
        more = asyncio.ensure_future(c.add(3))
        await asyncio.sleep(0.05)
        assert rec.batches == [[0]]  # the second batch waits for the first flush to end
        rec.hold.set()
        await asyncio.wait_for(asyncio.gather(first, *later, more), 5)

    asyncio.run(scenario())
    assert rec.batches == [[0], [1, 2, 3]]


def test_linger_gathers_items_that_come_apart_and_max_items_closes_a_batch() -> None:
    rec = Recorder()

    async def scenario() -> None:
        c: Coalescer[int] = Coalescer(rec, linger=0.1, max_wait=1.0, max_items=3)
        a = asyncio.ensure_future(c.add(0))
        await asyncio.sleep(0.02)
        b = [asyncio.ensure_future(c.add(i)) for i in (1, 2, 3)]
        await asyncio.wait_for(asyncio.gather(a, *b), 5)

    asyncio.run(scenario())
    assert rec.batches == [[0, 1, 2], [3]]


def test_a_flush_that_raises_fails_every_item_of_its_batch() -> None:
    async def broken(items: list[int]) -> list[BaseException | None]:
        raise RuntimeError("store down")

    async def scenario() -> list[Any]:
        c: Coalescer[int] = Coalescer(broken)
        return list(await asyncio.gather(c.add(1), c.add(2), return_exceptions=True))

    assert [str(o) for o in asyncio.run(scenario())] == ["store down", "store down"]


class FakeBackend:
    """Results by key, read as the embedded store's (``mget`` of ``get_key_for_task``)."""

    def __init__(self, stored: dict[str, str]) -> None:
        self.stored = stored

    def get_key_for_task(self, key: str) -> bytes:
        return key.encode()

    def mget(self, keys: list[bytes]) -> list[Any]:
        return [self.stored.get(k.decode()) for k in keys]

    def decode_result(self, raw: str) -> dict[str, Any]:
        return {"status": raw}


class FakeApp:
    def __init__(self, stored: dict[str, str]) -> None:
        self.backend = FakeBackend(stored)
        self.sent: list[tuple[str, list[Any], str]] = []

    def send_task(self, name: str, args: list[Any], task_id: str) -> None:
        self.sent.append((name, args, task_id))


@pytest.fixture
def stages() -> Any:
    made: list[CeleryStages] = []

    def make(stored: dict[str, str]) -> tuple[CeleryStages, FakeApp]:
        app = FakeApp(stored)
        s = CeleryStages(app)
        made.append(s)
        return s, app

    yield make
    for s in made:
        s.close()


def test_groups_scored_together_share_one_reward_task_skipping_keys_with_a_result(stages: Any) -> None:
    s, app = stages({"j.p1.score": "SUCCESS", "j.p2.score": "STARTED", "j.p4.score": "FAILURE"})
    members = [(f"j.p{i}.score", {"id": f"g{i}"}, {"spec": 1}) for i in range(5)]
    s._publish_score_task(members)
    assert len(app.sent) == 1
    name, args, task_id = app.sent[0]
    # p1 has a result, p2 runs somewhere: both awaited, not scored again; a failed p4 is tried again
    assert name == SCORE_MANY and task_id.startswith("scores-")
    assert args == [[["j.p0.score", {"id": "g0"}, {"spec": 1}], ["j.p3.score", {"id": "g3"}, {"spec": 1}],
                     ["j.p4.score", {"id": "g4"}, {"spec": 1}]]]  # fmt: skip


def test_a_group_scored_alone_is_its_own_score_group_task_under_its_key(stages: Any) -> None:
    s, app = stages({"j.p1.score": "SUCCESS"})
    s._publish_score_task([("j.p0.score", {"id": "g0"}, {}), ("j.p1.score", {"id": "g1"}, {})])
    assert app.sent == [(SCORE, [{"id": "g0"}, {}], "j.p0.score")]
    s._publish_score_task([("j.p1.score", {"id": "g1"}, {})])
    assert len(app.sent) == 1  # every member has a result: nothing is published


def test_groups_stored_together_take_consecutive_sequence_numbers_in_one_commit(tmp_path: Any) -> None:
    from gateway.state import GatewayState

    state = GatewayState(tmp_path / "gw.sqlite")
    state.jobs.add_group("job-x", 5, {"index": 5})
    state.jobs.add_groups("job-x", [(2, {"index": 2}), (5, {"index": 5, "again": True}), (0, {"index": 0})])
    # an index stored before is kept as it was; the others follow in order
    assert state.jobs.groups("job-x") == [(0, {"index": 5}), (1, {"index": 2}), (2, {"index": 0})]
    assert state.jobs.done_indices("job-x") == {0, 2, 5}


def test_a_commit_of_this_process_wakes_the_watching_streams_at_once(tmp_path: Any) -> None:
    from gateway.state import GatewayState

    state = GatewayState(tmp_path / "gw.sqlite")

    async def scenario() -> tuple[bool, bool]:
        woken = asyncio.Event()
        state.db.watch(woken)
        await asyncio.sleep(0.05)
        quiet = woken.is_set()  # nothing committed yet
        await asyncio.to_thread(state.jobs.add_groups, "job-w", [(0, {"index": 0})])  # another thread
        await asyncio.wait_for(woken.wait(), 5)
        state.db.unwatch(woken)
        woken.clear()
        await asyncio.to_thread(state.jobs.add_groups, "job-w", [(1, {"index": 1})])
        await asyncio.sleep(0.05)
        return quiet, woken.is_set()

    assert asyncio.run(scenario()) == (False, False)
