"""The search model's traces (zoo/search/traces.py): the written search is complete and exact, every
format parses back with the tiny model's parsers, and the problems keep the held-out split."""

from __future__ import annotations

import random

import pytest

from loom.answers import last_boxed
from loom.exact import check_countdown
from loom.formats import DEFAULT_SPAWN
from zoo.search import search_problems, solving_moves
from zoo.search.traces import (
    DRAWN,
    build_trace,
    finish,
    moves,
    plain_trace,
    reflect_trace,
    search,
    spawn_trace,
    stream_trace,
)
from zoo.tiny import is_held_out, parse_spawn, split_stream_text
from zoo.tiny.traces import child_message, join_block, trace_text

PROBLEMS = search_problems("countdown", 120, seed=3, split="train")


def test_the_moves_of_a_pool_are_every_pair_and_exact_op_once():
    got = {(m.x, m.op, m.y, m.r, m.rest) for m in moves((3, 5, 7))}
    assert (5, "*", 3, 15, (15, 7)) in got
    assert (7, "-", 3, 4, (5, 4)) in got
    assert not any(m.op == "/" and m.x % m.y for m in moves((3, 5, 7)))  # 5/3, 7/3, 7/5 are not exact
    assert len(got) == 3 * 3  # + - * on each pair, no exact division
    assert {(m.x, m.op, m.y) for m in moves((2, 2, 4))} >= {(2, "/", 2), (4, "/", 2), (2, "+", 2)}


def test_finish_finds_the_last_move_or_none():
    assert finish(22, (15, 7)) == "15+7=22"
    assert finish(8, (15, 7)) == "15-7=8"
    assert finish(3, (15, 5)) == "15/5=3"
    assert finish(23, (15, 7)) is None


def test_search_stops_at_the_first_solving_move_and_says_no_before_it():
    order = [m for m in moves((3, 5, 7)) if m.op != "*"] + [m for m in moves((3, 5, 7)) if m.op == "*"]
    lines, solution = search(22, order)
    assert solution == ["5*3=15", "15+7=22"]
    assert lines[-1] == "5*3=15 [15,7] 22 8 105 - 22? yes 15+7=22"  # the target echoed before the verdict
    assert all(line.endswith(" no") for line in lines[:-1]) and len(lines) >= 6


@pytest.mark.parametrize("problem", PROBLEMS[:60], ids=lambda p: p.text)
def test_every_format_writes_a_verified_answer(problem):
    for fmt in ("plain", "reflect"):
        text = trace_text(build_trace(problem, fmt)[0])
        assert check_countdown(last_boxed(text) or "", list(problem.numbers), problem.target), (fmt, text)
    segments, final = split_stream_text(trace_text(stream_trace(problem)))
    assert segments and check_countdown(last_boxed(final) or "", list(problem.numbers), problem.target)


def test_drawn_orders_vary_with_the_variant_and_the_fixed_order_does_not():
    texts = {trace_text(plain_trace(p, v, DRAWN)) for p in PROBLEMS[:20] for v in (0, 1)}
    assert len(texts) > 20  # some problems are searched in two orders
    assert trace_text(plain_trace(PROBLEMS[0], 1, DRAWN)) == trace_text(plain_trace(PROBLEMS[0], 1, DRAWN))
    one = trace_text(plain_trace(PROBLEMS[0]))
    assert {trace_text(plain_trace(PROBLEMS[0], v)) for v in range(4)} == {one}
    fixed = plain_trace(PROBLEMS[0])[1].text.splitlines()[1:-1]
    steps = [line.split()[0] for line in fixed]
    order = [m.step for m in moves(PROBLEMS[0].numbers)]
    assert steps == order[: len(steps)]  # the fixed order is moves()'s, stopped at the first yes
    assert "?" not in plain_trace(PROBLEMS[0], 0, DRAWN)[1].text
    assert trace_text(reflect_trace(PROBLEMS[0])) == trace_text(reflect_trace(PROBLEMS[0]))


def test_spawn_children_search_their_pair_and_the_join_holds_their_messages():
    for problem in PROBLEMS[:40]:
        t = spawn_trace(problem)
        parent = trace_text(t.parent)
        spawned = parse_spawn(parent)
        assert spawned is not None and len(spawned) == 3
        assert join_block(t.messages) in parent
        for (_, _, message), child, returned in zip(spawned, t.children, t.messages, strict=True):
            assert trace_text(child).startswith(f"[child] {message}\n")
            assert child_message(child[1].text) == returned
        found = [m for m in t.messages if m != DEFAULT_SPAWN.no_solution]
        assert found, problem.text
        assert check_countdown(last_boxed(parent) or "", list(problem.numbers), problem.target)


def test_problems_have_few_solving_moves_and_respect_the_split():
    assert all(solving_moves(p) <= 2 for p in PROBLEMS)
    assert not any(is_held_out(p) for p in PROBLEMS)
    test = search_problems("countdown", 30, seed=3, split="test")
    assert all(is_held_out(p) for p in test)
    assert search_problems("countdown", 30, seed=3, split="test") == test  # same arguments, same list


def test_the_search_is_long_enough_to_branch():
    """Issue 29's point: several steps per trace (the tiny model's Countdown traces have 2)."""
    lines = [len(plain_trace(p)[1].text.splitlines()) - 2 for p in PROBLEMS]
    assert sum(lines) / len(lines) > 3.5
    assert max(lines) >= 8


def test_a_shuffled_search_is_complete():
    rng = random.Random(0)
    for problem in PROBLEMS:
        order = moves(problem.numbers)
        rng.shuffle(order)
        _, solution = search(problem.target, order)
        assert solution is not None
