"""Generators are seeded, verifiers are exact, and every trace format parses back and verifies."""

from __future__ import annotations

import random

import pytest

from loom.answers import last_boxed
from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, FORCED_ENDING
from zoo.tiny.tasks import Problem, is_held_out, make_problems
from zoo.tiny.traces import (
    build_trace,
    child_message,
    expression_from_steps,
    parse_spawn,
    parse_stream,
    reflect_trace,
    spawn_trace,
    split_stream_text,
    stream_prompt,
    stream_trace,
    trace_text,
)


@pytest.mark.parametrize("kind", ["arith", "countdown"])
def test_generators_are_seeded_and_distinct(kind):
    a = make_problems(kind, 50, seed=3)
    assert a == make_problems(kind, 50, seed=3)
    assert a != make_problems(kind, 50, seed=4)
    assert len({p.key for p in a}) == 50


def test_train_and_test_splits_are_disjoint():
    train = make_problems("arith", 300, seed=0, split="train")
    test = make_problems("arith", 30, seed=1, split="test")
    assert all(is_held_out(p) for p in test)
    assert not any(is_held_out(p) for p in train)
    assert not {p.key for p in train} & {p.key for p in test}


@pytest.mark.parametrize("kind", ["arith", "countdown"])
def test_verifier_accepts_gold_and_rejects_wrong(kind):
    for p in make_problems(kind, 100, seed=7):
        assert p.verify(p.gold), p
        assert not p.verify(None)
        assert not p.verify("")
        assert not p.verify("__import__('os')")
        if kind == "arith":
            assert not p.verify(str(int(p.gold) + 1))
        else:
            assert not p.verify(f"{p.gold}+1")  # reaches another value / uses an extra number
            assert not p.verify(str(p.target))  # the target alone does not use the numbers


def test_difficulty_knobs_change_the_problems():
    big = make_problems("arith", 20, seed=0, ops=("+",), digits=(5, 5))
    assert all(len(str(p.a)) == 5 and p.op == "+" for p in big)
    four = make_problems("countdown", 20, seed=0, n_numbers=4)
    assert all(len(p.numbers) == 4 and p.verify(p.gold) for p in four)


def test_arith_problem_gold_is_the_value():
    for p in make_problems("arith", 200, seed=1):
        value = {"+": p.a + p.b, "-": p.a - p.b, "*": p.a * p.b}[p.op]
        assert p.gold == str(value)


@pytest.mark.parametrize("kind", ["arith", "countdown"])
@pytest.mark.parametrize("fmt", ["plain", "reflect"])
def test_plain_and_reflect_traces_end_in_a_verified_boxed_answer(kind, fmt):
    for p in make_problems(kind, 30, seed=2):
        traces = build_trace(p, fmt)
        assert len(traces) == (2 if fmt == "reflect" else 1)  # reflect: 1-3 re-checks and a 0-1 variant
        for pieces in traces:
            assert not pieces[0].train and pieces[-1].train
            completion = trace_text(pieces[1:])
            assert completion.startswith("<think> ") and "</think>" in completion
            assert p.verify(last_boxed(completion))
        # the answer in the last step line agrees with the gold (arith column steps end with r<gold>)
        if kind == "arith" and fmt == "plain":
            body = completion.split("</think>")[0]
            assert body.strip().split("r")[-1].lstrip("0") == p.gold.lstrip("-").lstrip("0") or p.gold == "0"


def test_reflect_trace_rechecks_the_number_of_times_asked():
    p = make_problems("arith", 1, seed=9)[0]
    for k in range(7):
        think = trace_text(reflect_trace(p, random.Random(k), checks=(k, k))).split("</think>")[0]
        assert think.count("\n\n") == k  # one blank line before each re-check
        assert think.count("Yes.") == k and f"So the answer is {p.gold}." in think


def test_reflect_trace_answers_early_then_rechecks():
    for p in make_problems("arith", 20, seed=5):
        text = trace_text(build_trace(p, "reflect")[0])
        think = text.split("</think>")[0]
        assert f"So the answer is {p.gold}." in think
        after = think.split(f"So the answer is {p.gold}.")[1].lower()
        assert any(k in after for k in ("wait", "alternatively", "check", "hmm", "verify"))
        assert FORCED_ENDING in text  # a truncated revision continues exactly like training


@pytest.mark.parametrize("kind", ["arith", "countdown"])
def test_stream_trace_parses_and_verifies(kind):
    m = DEFAULT_MARKERS
    skips = 0
    for p in make_problems(kind, 40, seed=3):
        pieces = stream_trace(p)
        header, observations = stream_prompt(p)
        assert pieces[0].text == header
        # observations are exactly the sentence pieces, never trained
        assert [x.text for x in pieces if x.text.endswith(m.sentence_end)] == observations
        assert all(not x.train for x in pieces if x.text.endswith(m.sentence_end))
        segments, final = split_stream_text(trace_text(pieces))
        parsed = parse_stream(segments, final)
        assert parsed.well_formed and p.verify(parsed.answer)
        assert len(parsed.thoughts) == len(observations)
        skips += sum(t == m.skip for t in parsed.thoughts)
    assert skips > 0


def test_stream_parse_rejects_missing_markers():
    bad = parse_stream(["a=1"], " 1+1=2 \\boxed{2}<EOA>")
    assert not bad.well_formed


def test_spawn_trace_children_return_what_the_join_holds():
    s = DEFAULT_SPAWN
    for p in make_problems("countdown", 40, seed=4):
        t = spawn_trace(p)
        parent = trace_text(t.parent)
        children = parse_spawn(parent)
        assert children is not None and len(children) == len(t.children) >= 2
        for (i, _, message), child, ret in zip(children, t.children, t.messages, strict=True):
            assert child[0].text == f"[child] {message}\n"
            assert child_message(trace_text(child[1:])) == ret
            assert s.join_child.format(i=i, message=ret) in parent
        assert any(m != s.no_solution for m in t.messages)
        assert not t.parent[2].train and t.parent[2].text.startswith("\n" + s.join_open)
        assert p.verify(last_boxed(parent.split(s.join_close)[1]))


def test_expression_from_steps_substitutes_results():
    assert expression_from_steps(["3*5=15", "15+7=22"]) == "(3*5)+7"
    assert expression_from_steps(["9/9=1", "1+1=2"]) == "(9/9)+1"
    p = Problem(kind="countdown", text="", gold="", numbers=(4, 6, 6), target=3)
    assert p.verify(expression_from_steps(["6/6=1", "4-1=3"]))


def test_traces_are_deterministic():
    p = make_problems("countdown", 1, seed=9)[0]
    assert build_trace(p, "spawn") == build_trace(p, "spawn")
    assert random.Random(0).random() == random.Random(0).random()
