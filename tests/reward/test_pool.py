"""The isolated verification pool: deadlines, kill-and-replace, recycling, guards, hostile corpus."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import reward_svc  # noqa: F401  (sets SYMPY_GROUND_TYPES before sympy loads)
from reward_svc.corpus import hostile, realistic_mix
from reward_svc.mathverify import Checker, MathItem
from reward_svc.pool import VerifierPool
from reward_svc.trace import answer_region

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 2  # the deadline of hostile and stuck items: what they may cost
# Items that must be answered get a roomy deadline: on a loaded 2-core machine (a CI run beside other
# suites) a fresh worker's first plain item took over 2 s, and the test then read its timeout as a
# wrong answer. What the tests check of them is the verdict, never the time.
ROOMY = 60
# A cut item's cost is bounded by its deadline plus the parent's reaction; under load that reaction
# waits for a time slice, so the bound allows a few seconds: an uncut item (a frozen worker, a tower
# of exponents) would never answer at all.
SLACK = 5


def item(gold: str, response: str) -> MathItem:
    kind, region = answer_region(response)
    return MathItem(gold, kind, region)


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(2, max_items=1000) as p:
        yield p


def test_realistic_mix_scores_right_and_wrong(pool):
    mix = realistic_mix(40, seed=1)
    verdicts = pool.check_many([item(g, r) for g, r, _ in mix], ROOMY)
    assert [v.status for v in verdicts] == ["ok"] * len(mix)
    assert [v.correct for v in verdicts] == [ok for _, _, ok in mix]


def test_hostile_corpus_costs_at_most_its_deadline_and_spares_the_batch(pool):
    normal = realistic_mix(10, seed=2)
    corpus = hostile()
    items = [item("42", r) for _, r in corpus] + [item(g, r) for g, r, _ in normal]
    timeouts_before = pool.stats.timeouts
    futures = [pool.submit(it, DEADLINE if i < len(corpus) else ROOMY) for i, it in enumerate(items)]
    verdicts = [f.result() for f in futures]
    by_name = dict(zip([n for n, _ in corpus], verdicts, strict=False))
    for name, v in by_name.items():
        assert v.seconds <= DEADLINE + SLACK, (name, v)
        if name == "100k characters then 42":
            assert v.status == "ok" and v.correct
        else:
            assert not v.correct, (name, v)
    for name in ("tower of exponents", "huge factorial", "huge power", "deep frac nesting"):
        assert by_name[name].status in ("timeout", "parse_error"), (name, by_name[name])
    assert by_name["100k of 1+"].status in ("timeout", "parse_error", "ok")
    rest = verdicts[len(corpus) :]
    assert [v.status for v in rest] == ["ok"] * len(normal)
    assert [v.correct for v in rest] == [ok for _, _, ok in normal]
    assert pool.stats.timeouts >= timeouts_before  # parent kills happen only when the alarms fail


def test_parent_kill_replaces_only_the_stuck_worker():
    with VerifierPool(2, max_items=1000) as p:
        # warm both workers, then note their pids
        assert all(v.correct for v in p.check_many([item("1", "\\boxed{1}")] * 4, ROOMY))
        before = set(p.worker_pids())
        # two workers, plus a spare where a loaded machine made one look slow (pool.py's spares)
        assert len(before) >= 2
        # 1 s deadline with math-verify's own alarm also at 1 s: the parent's poll expires first or
        # together; either way the item is a timeout and the batch continues
        stuck = p.submit(item("42", "\\boxed{(10^9)!}"), 1)
        normal = [p.submit(item("7", "\\boxed{7}"), ROOMY) for _ in range(6)]
        assert stuck.result().status == "timeout"
        assert all(f.result().correct for f in normal)
        after = set(p.worker_pids())
        assert len(before & after) >= 1  # the healthy worker was not touched


def test_hard_deadline_kills_a_worker_that_ignores_its_alarm():
    """A worker stuck where signal.alarm cannot reach (SIGALRM ignored) is killed from outside."""
    with VerifierPool(1, max_items=1000) as p:
        assert p.check_many([item("2", "\\boxed{2}")], ROOMY)[0].correct
        (pid,) = p.worker_pids()
        os.kill(pid, subprocess.signal.SIGSTOP)  # frozen: its alarm cannot fire, it cannot answer
        v = p.check_many([item("3", "\\boxed{3}")], 1)[0]
        assert v.status == "timeout" and v.seconds <= 1 + SLACK
        assert p.stats.timeouts == 1
        assert p.check_many([item("3", "\\boxed{3}")], ROOMY)[0].correct  # a fresh worker
        assert pid not in p.worker_pids()


def test_items_queued_behind_a_killed_item_run_on_the_fresh_worker():
    """One worker, pipelined: the items already in the pipe behind a frozen item never started;
    they are re-sent to the replacement worker and scored, and only the frozen one times out."""
    with VerifierPool(1, max_items=1000) as p:
        assert p.check_many([item("2", "\\boxed{2}")], ROOMY)[0].correct
        (pid,) = p.worker_pids()
        os.kill(pid, subprocess.signal.SIGSTOP)  # frozen before it reads the next items
        frozen = p.submit(item("3", "\\boxed{3}"), 1)
        behind = [p.submit(item(g, f"\\boxed{{{g}}}"), ROOMY) for g in ("4", "5")]
        verdicts = [frozen.result()] + [f.result() for f in behind]
        assert verdicts[0].status == "timeout"
        assert [(v.status, v.correct) for v in verdicts[1:]] == [("ok", True), ("ok", True)]
        assert p.stats.timeouts == 1 and pid not in p.worker_pids()


def test_a_large_item_never_waits_in_the_pipe_of_a_stuck_worker():
    """An item larger than the pipe buffer queued behind a frozen one would block the driver in
    send() and with it the deadline; it waits for the fresh worker instead."""
    with VerifierPool(1, max_items=1000) as p:
        assert p.check_many([item("2", "\\boxed{2}")], ROOMY)[0].correct
        (pid,) = p.worker_pids()
        os.kill(pid, subprocess.signal.SIGSTOP)
        big = MathItem("5", "boxed", "x" * 2_000_000 + "\\boxed{5}")
        verdicts = p.check_many([item("3", "\\boxed{3}"), big], 1)
        assert verdicts[0].status == "timeout" and verdicts[0].seconds <= 1 + SLACK
        assert verdicts[1].status in ("ok", "parse_error", "timeout")  # answered, not hung


def test_workers_recycle_after_n_items():
    # no spares: on a loaded machine an item running past slow_item_s would fork one and add to forks
    with VerifierPool(1, max_items=3, pipeline_depth=1, spare_workers=0) as p:
        verdicts = p.check_many([item("5", "\\boxed{5}")] * 7, ROOMY)
        assert all(v.correct for v in verdicts)
        assert p.stats.recycles == 2 and p.stats.forks == 3  # items 1-3, 4-6, 7
    # pipelined (the default, depth 2): a worker due for recycling first answers the item already in
    # its pipe, so it serves max_items + 1: items 1-4, then 5-7 (due again at 7, retired when idle)
    with VerifierPool(1, max_items=3, spare_workers=0) as p:
        verdicts = p.check_many([item("5", "\\boxed{5}")] * 7, ROOMY)
        assert all(v.correct for v in verdicts)
        assert p.stats.recycles == 2 and p.stats.forks == 2


def test_model_text_is_never_evaluated_as_python(tmp_path, pool):
    marker = tmp_path / "pwned"
    payloads = [
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        f"The answer is __import__('os').system('touch {marker}')",
        f"$__import__('os').system('touch {marker}')$",
    ]
    verdicts = pool.check_many([item("42", t) for t in payloads], DEADLINE)
    assert not marker.exists()
    assert not any(v.correct for v in verdicts)


def test_guards_refuse_parse_expr_and_sympy_uses_python_ground_types():
    code = (
        "import reward_svc\n"
        "from reward_svc.mathverify import install_guards, RefusedEval\n"
        "install_guards()\n"
        "import math_verify.parser as p\n"
        "from math_verify import parse, ExprExtractionConfig\n"
        "try:\n    p.parse_expr_cached('1+1')\nexcept RefusedEval:\n    print('refused')\n"
        "print(parse('so 1+1', [ExprExtractionConfig()]))\n"
        "from sympy.external.gmpy import GROUND_TYPES\nprint(GROUND_TYPES)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SYMPY_GROUND_TYPES"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    ).stdout.split()
    assert out[0] == "refused"
    assert "2" not in out[1]  # the plain-expression path could not evaluate "1+1"
    assert out[-1] == "python"


def test_gold_is_parsed_once_per_worker():
    checker = Checker()
    for answer in ("\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{0.4}"):
        checker.check(item("\\frac{1}{2}", answer), 3)
    assert checker.gold_hits == 2


def test_statuses_for_missing_and_unparseable_answers(pool):
    verdicts = pool.check_many(
        [item("42", "no digits here at all"), item("42", "\\boxed{}"), item("", "\\boxed{1}")], ROOMY
    )
    assert [v.status for v in verdicts] == ["no_answer", "parse_error", "invalid"]


def test_a_slow_item_forks_one_spare_not_every_spare_slot():
    """One slow worker gets one spare at once (issue 37): forking every spare slot per slow item
    blocked the scheduler for a fork each and took cores from the regular workers for their warm-up.
    Another request that needs a spare while the first is busy still gets one on demand."""
    with VerifierPool(4, max_items=1000, spare_workers=4) as p:
        p.check_many([item("1", "\\boxed{1}")] * 8, 5)  # every regular worker forked and warm
        while len(p.worker_pids()) > 4:  # a loaded machine made a warm-up item look slow: its spare goes
            p.check_many([item("1", "\\boxed{1}")], 5)
        before = p.stats.spares
        stuck = p.submit(item("42", "\\boxed{(10^9)!}"), 3)
        assert stuck.result(timeout=60).status == "timeout"
        assert p.stats.spares - before == 1
        assert p.check_many([item("2", "\\boxed{2}")], 5)[0].status == "ok"  # the pool still serves
