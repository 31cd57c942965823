"""The ``gold`` detector's verifier on hostile text: linear scans, typed statuses."""

import random
import re
import time

import pytest

from reward_svc.match import MatchRequest, expressions, plan_matches

_OLD_EXPR = re.compile(r"[\d()][\d\s()+\-*/]*[\d)]")


def test_expressions_are_what_the_old_regex_found():
    rng = random.Random(0)
    alphabet = list("12( )+-*/x=\n") + ["\u0663", "\u2003"]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        assert expressions(text) == [m.group(0) for m in _OLD_EXPR.finditer(text)], repr(text)
    assert expressions("so (3 + 4) * 2 = 14.") == ["(3 + 4) * 2", "14"]


@pytest.mark.timeout(60)
def test_expression_scan_is_linear_on_open_parentheses():
    # the old regex backtracked once per start: about 4 minutes for this text
    req = MatchRequest(task="countdown", meta={"numbers": [1, 2], "target": 3}, texts=["(" * 200_000])
    t0 = time.perf_counter()
    decided, math = plan_matches(req)
    assert time.perf_counter() - t0 < 5
    assert [v.status for v in decided if v is not None] == ["no_answer"] and not math


@pytest.mark.parametrize(
    ("task", "label", "meta", "text", "status"),
    [
        ("countdown", "[" * 5000, {}, "1+2", "invalid"),
        ("countdown", None, {"numbers": [1, 2], "target": float("inf")}, "1+2", "invalid"),
        ("arithmetic", "1" * 5000, {}, "3", "invalid"),
        ("arithmetic", "3", {}, "\\boxed{" + "1" * 5000 + "}", "parse_error"),
        ("arithmetic", "3", {}, "it is " + "1" * 5000, "parse_error"),
        ("arithmetic", "3", {}, "so 1 + 2 = 3", "ok"),
        ("countdown", None, {"numbers": [1, 2], "target": 3}, "try 1 + 2 then", "ok"),
    ],
)
def test_hostile_labels_and_answers_get_a_status(task, label, meta, text, status):
    decided, math = plan_matches(MatchRequest(task=task, label=label, meta=meta, texts=[text]))
    assert not math and decided[0] is not None and decided[0].status == status
