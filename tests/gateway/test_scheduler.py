"""The rollout tier's fair scheduler: deficit round robin's order (pure) and the gate's slots."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gateway.scheduler import DrrState, FairGate, drr_order


def test_a_small_job_goes_before_a_flood_it_came_after() -> None:
    queues = {"A": [1.0] * 16, "B": [1.0]}
    order, _ = drr_order(queues, {}, quantum=1.0)
    assert order[:2] == [("A", 0), ("B", 0)]  # B waits one turn of A, not its 16 groups
    assert [k for k, _ in order[2:]] == ["A"] * 15
    assert [i for k, i in order if k == "A"] == list(range(16))  # a key's own tasks in order


def test_equal_weights_alternate_and_weights_scale_the_share() -> None:
    order, _ = drr_order({"A": [1.0] * 8, "B": [1.0] * 8}, {}, quantum=1.0, limit=6)
    assert [k for k, _ in order] == ["A", "B"] * 3
    order, _ = drr_order({"A": [1.0] * 30, "B": [1.0] * 30}, {"A": 2.0}, quantum=1.0, limit=30)
    assert Counter(k for k, _ in order) == {"A": 20, "B": 10}


def test_cost_counts_not_the_number_of_tasks() -> None:
    """A key whose groups cost 4x as much gets a quarter of the groups (the same tokens)."""
    order, _ = drr_order({"big": [4.0] * 20, "small": [1.0] * 80}, {}, quantum=4.0, limit=50)
    n = Counter(k for k, _ in order)
    assert n["small"] == 4 * n["big"]


def test_the_state_carries_turns_across_calls() -> None:
    """Released one at a time (a slot frees, the next is chosen) is the order released all at once."""
    queues = {"A": [1.0] * 6, "B": [2.0] * 3, "C": [1.0] * 2}
    weights = {"B": 0.5}
    whole, _ = drr_order(queues, weights, quantum=2.0)
    state, heads, one_by_one = DrrState(), dict.fromkeys(queues, 0), []
    for _ in range(11):
        left = {k: q[heads[k] :] for k, q in queues.items()}
        got, state = drr_order(left, weights, quantum=2.0, state=state, limit=1)
        (k, i) = got[0]
        one_by_one.append((k, heads[k] + i))
        heads[k] += 1
    assert one_by_one == whole


def test_a_newcomer_joins_at_the_end_of_the_round() -> None:
    _, state = drr_order({"A": [1.0] * 4, "B": [1.0] * 4}, {}, quantum=1.0, limit=3)  # A B A
    assert state.ring == ("B", "A")
    order, _ = drr_order({"A": [1.0] * 2, "B": [1.0] * 3, "C": [1.0]}, {}, 1.0, state, limit=3)
    assert [k for k, _ in order] == ["B", "A", "C"]


def test_tiny_weights_do_not_spin() -> None:
    order, _ = drr_order({"A": [1000.0] * 2, "B": [1000.0]}, {"A": 1e-6, "B": 1e-6}, quantum=1.0)
    assert sorted(order) == [("A", 0), ("A", 1), ("B", 0)]


def test_gate_holds_the_window_and_serves_a_late_key_next() -> None:
    """With a flood of key A queued behind a full window, key B's task is granted the next slot."""

    async def go() -> list[str]:
        gate = FairGate(window=2, tenant=lambda scope: (scope.split("-")[0], 1.0), log_limit=100)
        peak = 0

        async def task(key: str, hold: asyncio.Event) -> None:
            nonlocal peak
            async with gate.slot(key, 1.0):
                peak = max(peak, gate.in_flight)
                await hold.wait()

        hold = asyncio.Event()
        flood = [asyncio.create_task(task(f"A-job.p{i}", hold)) for i in range(10)]
        await asyncio.sleep(0)
        late = asyncio.create_task(task("B-job.p0", hold))
        await asyncio.sleep(0)
        assert gate.in_flight == 2 and gate.waiting() == {"A": 8, "B": 1}
        hold.set()
        await asyncio.gather(*flood, late)
        assert peak == 2 and gate.in_flight == 0 and gate.waiting() == {}
        return gate.dispatched

    dispatched = asyncio.run(go())
    # A's queue was waiting first, so its turn comes first when a slot frees; B's comes next, ahead
    # of the 7 A tasks left
    assert dispatched == ["A-job.p0", "A-job.p1", "A-job.p2", "B-job.p0"] + [
        f"A-job.p{i}" for i in range(3, 10)
    ]


def test_a_cancelled_waiter_leaves_its_queue_and_a_cancelled_holder_its_slot() -> None:
    async def go() -> None:
        gate = FairGate(window=1)
        hold = asyncio.Event()

        async def task(key: str) -> None:
            async with gate.slot(key, 1.0):
                await hold.wait()

        first = asyncio.create_task(task("a.p0"))
        second = asyncio.create_task(task("a.p1"))
        await asyncio.sleep(0)
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert gate.waiting() == {}
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert gate.in_flight == 0
        third = asyncio.create_task(task("b.p0"))
        await asyncio.sleep(0)
        assert gate.in_flight == 1  # the freed slot is taken
        hold.set()
        await third

    asyncio.run(go())


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match="window"):
        FairGate(window=0)
