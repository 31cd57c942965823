"""Accuracy planning on hostile text: linear scans, and a typed status instead of an exception."""

import json
import time

import pytest
from pydantic import ValidationError

from loom.contracts.rewards import MAX_ANSWER_CHARS, AccuracyParams
from loom.contracts.wire import Group, RewardSpec
from reward_svc.accuracy import extract_choice, plan, read_gold
from reward_svc.core import plan_group
from reward_svc.mathverify import Verdict


@pytest.mark.parametrize(
    ("text", "choice"),
    [
        ("The answer is (B).", "B"),
        ("Answer: C", "C"),
        ("so the correct option is d.", "d"),
        ("Choice (A) fails; the answer is: E", "E"),
        ("I pick (C) here", "C"),
        ("\\boxed{D} answer is B", "D"),
        ("nothing here", None),
        ("Both answers agree: (C)", "C"),  # "answers" is not the cue "answer" with the choice "s"
    ],
)
def test_choice_cue_and_fallbacks(text, choice):
    assert extract_choice(text) == choice


@pytest.mark.timeout(60)
def test_choice_cue_scan_is_linear_on_long_whitespace():
    # the old cue regex backtracked cubically here: about 8 minutes for this one text
    t0 = time.perf_counter()
    assert extract_choice("answer" + " " * 5000 + "1", tail_chars=6000) is None
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("tail_chars", [0, -5, MAX_ANSWER_CHARS + 1])
def test_tail_chars_out_of_bounds_is_refused(tail_chars):
    with pytest.raises(ValidationError) as exc:
        AccuracyParams(tail_chars=tail_chars)
    assert exc.value.errors()[0]["loc"] == ("tail_chars",)


@pytest.mark.parametrize(
    ("task", "label", "meta"),
    [
        ("countdown", "[" * 5000, {}),  # json.loads: RecursionError
        ("countdown", '{"numbers": [1, 2], "target": Infinity}', {}),  # int(inf): OverflowError
        ("countdown", None, {"numbers": [1, 2], "target": float("inf")}),
        ("countdown", None, {"numbers": [1, 2], "target": float("nan")}),
        ("countdown", None, {"numbers": ["9" * 5000], "target": 3}),  # int(): digit limit
        ("arithmetic", "1" * 5000, {}),  # Fraction(): digit limit
        ("arithmetic", "1." + "1" * 5000, {}),
        ("arithmetic", "forty-two", {}),
        ("choice", " ", {}),
    ],
)
def test_hostile_gold_is_invalid_for_every_trajectory(task, label, meta):
    gold = read_gold(task, label, meta)
    assert isinstance(gold, Verdict) and gold.status == "invalid"
    assert plan(task, gold, "\\boxed{1+2}", AccuracyParams()).status == "invalid"


@pytest.mark.parametrize(
    ("task", "label", "text", "status"),
    [
        ("arithmetic", "3", "\\boxed{" + "1" * 5000 + "}", "parse_error"),
        ("arithmetic", "3", "\\boxed{1." + "1" * 5000 + "}", "parse_error"),
        ("arithmetic", "3", "\\boxed{" + "9" * 40 + "*" + "9" * 40 + "}", "parse_error"),
        (
            "countdown",
            json.dumps({"numbers": [1, 2], "target": 3}),
            "\\boxed{" + "(" * 5000 + "}",
            "parse_error",
        ),
        (
            "countdown",
            json.dumps({"numbers": [1, 2], "target": 3}),
            "\\boxed{" + "-" * 5000 + "1}",
            "parse_error",
        ),
        ("countdown", json.dumps({"numbers": [1, 2], "target": 3}), "\\boxed{1/(2-2)}", "parse_error"),
        ("countdown", json.dumps({"numbers": [1, 2], "target": 10**400}), "\\boxed{1+2}", "ok"),
    ],
)
def test_hostile_answers_get_a_status(task, label, text, status):
    gold = read_gold(task, label, {})
    assert plan(task, gold, text, AccuracyParams()).status == status


@pytest.mark.timeout(120)
def test_gold_is_read_once_per_group():
    # normalising this label took ~15 ms; once per trajectory, 4096 of them blocked the loop a minute
    trajs = [{"id": f"t{i}", "group_id": "g", "text": "\\boxed{B}"} for i in range(4096)]
    group = Group(id="g", label="\\text{B} " * 22_000, task="choice", trajectories=trajs)
    t0 = time.perf_counter()
    p = plan_group(group, RewardSpec())
    assert time.perf_counter() - t0 < 5
    assert {v.status for v in p.verdicts if v is not None} == {"ok"}
