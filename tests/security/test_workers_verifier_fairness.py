"""The verifier pool is fair across requests (issue 24, item 3): one request's hostile items do not hold
up another request's items, and a request's hostile items run side by side on idle workers instead of
queueing in one worker's pipe. Real forked math-verify workers; the hostile items are ones math-verify
really spends its whole deadline on (its own alarm stops them: ``timeout``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

import reward_svc  # noqa: F401  (sets SYMPY_GROUND_TYPES before sympy loads)
from reward_svc.corpus import realistic_mix
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.pool import VerifierPool
from reward_svc.trace import answer_region

# each of these runs until math-verify's alarm (deadline - 1 s) in a worker (measured: 19 s at 20)
HOSTILE = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^9)!}", "\\boxed{10^{10^{10}}}", "\\boxed{2^{10^{10}}}"]


def item(gold: str, response: str) -> MathItem:
    kind, region = answer_region(response)
    return MathItem(gold, kind, region)


HOSTILE_TIMEOUT_S = 20


def hostile(n: int) -> list[MathItem]:
    return [item("42", HOSTILE[i % len(HOSTILE)]) for i in range(n)]


def in_thread(pool: VerifierPool, items: list[MathItem], deadline_s: int) -> Future[list[Verdict]]:
    """``check_many`` (one request) from its own thread, as a service's request handler calls it."""
    out: Future[list[Verdict]] = Future()

    def call() -> None:
        try:
            out.set_result(pool.check_many(items, deadline_s))
        except BaseException as exc:
            out.set_exception(exc)

    threading.Thread(target=call, daemon=True).start()
    return out


def test_normal_requests_are_answered_beside_four_hostile_items_without_waiting_for_them():
    """The issue's case: 4 hostile items at timeout_s=20 (both workers stuck ~19 s each, twice), then
    3 normal requests 1 s later: each is answered with right verdicts while the hostile request is
    still running, far sooner than a hostile item's deadline (queued behind one it would wait ~19 s).
    The seconds themselves (0.1-1.1 s on a quiet machine) are bench/reward.py's section 4: a test on a
    loaded machine asserts the order, not a wall-clock figure."""
    normal = realistic_mix(3, seed=11)
    with VerifierPool(2, max_items=1000) as pool:
        assert all(v.correct for v in pool.check_many([item("1", "\\boxed{1}")] * 4, 5))  # warm
        bad = in_thread(pool, hostile(4), HOSTILE_TIMEOUT_S)
        time.sleep(1.0)

        def one(case: tuple[str, str, bool]) -> tuple[float, Verdict]:
            t0 = time.monotonic()
            (v,) = pool.check_many([item(case[0], case[1])], 5)
            return time.monotonic() - t0, v

        with ThreadPoolExecutor(3) as ex:
            answers = [f.result(timeout=15) for f in [ex.submit(one, c) for c in normal]]
        for (seconds, v), (_, _, expected) in zip(answers, normal, strict=True):
            assert v.status == "ok" and v.correct == expected
            assert seconds < HOSTILE_TIMEOUT_S / 2, [round(s, 2) for s, _ in answers]
        assert not bad.done()  # the hostile items were still running all along
        assert pool.stats.spares >= 1
    with pytest.raises(RuntimeError):  # closed under it: its callers are answered, never left waiting
        bad.result(timeout=15)


@pytest.mark.parametrize(
    "layout",
    [["h", "h"], ["h", "n", "h"]],
    ids=["two hostile items", "hostile, normal, hostile"],
)
def test_hostile_items_of_one_request_run_side_by_side_on_idle_workers(layout):
    """Two hostile items of one request on a 2-worker pool take one deadline, not two: the second never
    waits in the pipe of the worker stuck on the first (put there, it is taken back once that worker is
    slow, and runs on the worker that is idle)."""
    deadline = 10
    items = [hostile(1)[0] if k == "h" else item("7", "\\boxed{7}") for k in layout]
    with VerifierPool(2, max_items=1000) as pool:
        assert all(v.correct for v in pool.check_many([item("1", "\\boxed{1}")] * 4, 5))  # warm
        t0 = time.monotonic()
        verdicts = pool.check_many(items, deadline)
        wall = time.monotonic() - t0
        if layout == ["h", "n", "h"]:  # the second went into the first's pipe (both pipes were equal)
            assert pool.stats.taken_back >= 1
    slow = [v for k, v in zip(layout, verdicts, strict=True) if k == "h"]
    assert all(v.status == "timeout" for v in slow), slow
    # really hostile: the request lasted until the alarms; side by side it lasts one deadline, in one
    # pipe two (the wall clock, not the verdicts' own seconds: a loaded machine may start one late)
    assert wall >= deadline - 2, (wall, [v.seconds for v in slow])
    assert wall < 1.75 * deadline, (wall, [v.seconds for v in slow])
    assert all(v.correct for k, v in zip(layout, verdicts, strict=True) if k == "n")


def test_a_request_stuck_on_its_own_slow_items_gets_no_spare_workers():
    """Spares are for the other requests: a hostile request keeps the regular workers only, so its
    third item waits for one of them (two deadlines in all, not one) and a normal request still finds
    a spare."""
    deadline = 6
    with VerifierPool(2, max_items=1000) as pool:
        assert all(v.correct for v in pool.check_many([item("1", "\\boxed{1}")] * 4, 5))
        t0 = time.monotonic()
        bad = in_thread(pool, hostile(3), deadline)
        time.sleep(1.0)
        t1 = time.monotonic()
        (v,) = pool.check_many([item("3", "\\boxed{3}")], 5)
        # answered while the hostile request still holds both regular workers (an order, not a
        # wall-clock figure: a loaded machine may make a normal item take seconds)
        assert v.correct and not bad.done(), time.monotonic() - t1
        verdicts = bad.result(timeout=60)
        wall = time.monotonic() - t0
    assert [v.status for v in verdicts] == ["timeout"] * 3
    assert wall >= 2 * (deadline - 2)
