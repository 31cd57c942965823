"""Does a text state the gold answer? The verifier behind reflect_svc's ``gold`` detector.

Each text (a chunk of a thinking part) is checked like an answer region, with what the accuracy
component uses: math goes to the isolated math-verify pool (last boxed answer, else the tail with
the last-number fallback); arithmetic and Countdown use Loom's exact verifier (last boxed answer,
else the last number / the last arithmetic expression of the text); choice the normalised option.
Pure: returns a ``Verdict`` or the ``MathItem`` a pool worker must check.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from loom.exact import ExprError, check_countdown, evaluate, parse_number
from loom.schemas import Contract, RewardStatus, TaskKind
from reward_svc.accuracy import Gold, extract_choice, normalise_choice, read_gold
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.trace import ANSWER_TAIL_CHARS, last_boxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_EXPR_RUN = re.compile(r"[\d\s()+\-*/]+")
_EXPR_HEAD = re.compile(r"[\d()]")
_EXPR_LAST = re.compile(r"[\d)]")


class MatchRequest(Contract):
    label: str | None = Field(default=None, description="gold answer; the API caps it at max_chars")
    task: TaskKind | None = None
    meta: dict[str, Any] = Field(default_factory=dict, description="countdown: numbers and target")
    texts: list[str] = Field(min_length=1, max_length=4096)
    timeout_s: int = Field(default=5, ge=1, le=300)


class MatchVerdict(Contract):
    status: RewardStatus
    correct: bool = False
    detail: str | None = None


class MatchResponse(Contract):
    verdicts: list[MatchVerdict]


def expressions(text: str) -> list[str]:
    r"""The arithmetic expressions in ``text``: in each maximal run of digits, spaces, parentheses
    and operators, the span from its first digit or parenthesis to its last digit or ")".

    Same spans as the regex ``[\d()][\d\s()+\-*/]*[\d)]`` but linear: that regex backtracks once
    per start, quadratically on a long run of "(".
    """
    found = []
    for m in _EXPR_RUN.finditer(text):
        run = m.group(0)
        head = _EXPR_HEAD.search(run)
        last = _EXPR_LAST.search(run[::-1])
        if head is not None and last is not None:
            start, end = head.start(), len(run) - last.start()
            if end - start >= 2:
                found.append(run[start:end])
    return found


def plan_match(task: str, gold: Gold | Verdict, text: str) -> Verdict | MathItem:
    """One text's verdict, or the math item to verify; ``gold`` is ``read_gold``'s."""
    if isinstance(gold, Verdict):
        return gold
    boxed = last_boxed(text)
    if task == "countdown":
        assert isinstance(gold, tuple)
        cands = [boxed.split("=")[0]] if boxed is not None else expressions(text)
        cands = [c for c in cands if any(op in c for op in "+-*/")]
        if not cands:
            return Verdict("no_answer")
        for c in reversed(cands):
            try:
                evaluate(c)
            except ExprError:
                continue
            return Verdict("ok", correct=check_countdown(c, gold[0], gold[1]))
        return Verdict("parse_error", detail="not an arithmetic expression")
    if task == "arithmetic":
        answer = boxed if boxed is not None else (_NUMBER.findall(text) or [None])[-1]
        if answer is None:
            return Verdict("no_answer")
        value = parse_number(answer)
        if value is None:
            return Verdict("parse_error", detail="not a number")
        return Verdict("ok", correct=value == gold)
    if task == "choice":
        choice = extract_choice(text)
        if choice is None:
            return Verdict("no_answer")
        return Verdict("ok", correct=normalise_choice(choice) == gold)
    assert isinstance(gold, str)
    if boxed is not None:
        return MathItem(gold=gold, kind="boxed", region=boxed)
    return MathItem(gold=gold, kind="tail", region=text[-ANSWER_TAIL_CHARS:], number_fallback=True)


def plan_matches(req: MatchRequest) -> tuple[list[Verdict | None], list[tuple[int, MathItem]]]:
    task = req.task or "math"
    gold = read_gold(task, req.label, req.meta)  # once: the label and meta are shared by every text
    decided: list[Verdict | None] = []
    math: list[tuple[int, MathItem]] = []
    for i, text in enumerate(req.texts):
        p = plan_match(task, gold, text)
        if isinstance(p, MathItem):
            decided.append(None)
            math.append((i, p))
        else:
            decided.append(p)
    return decided, math


def finish_matches(
    decided: list[Verdict | None], math: list[tuple[int, MathItem]], verdicts: list[Verdict]
) -> MatchResponse:
    for (i, _), v in zip(math, verdicts, strict=True):
        decided[i] = v
    return MatchResponse(
        verdicts=[
            MatchVerdict(status=v.status, correct=v.correct, detail=v.detail)  # type: ignore[arg-type]
            for v in decided
            if v is not None
        ]
    )
