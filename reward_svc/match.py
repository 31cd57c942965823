"""Does a text state the gold answer? The verifier behind reflect_svc's ``gold`` detector.

Each text (a chunk of a thinking part) goes through the accuracy component's chain
(``accuracy.plan``, default params): math goes to the isolated math-verify pool (last boxed answer,
else the tail with the last-number fallback); choice the normalised option. Only the exact tasks'
candidates differ (``stated_answers``): arithmetic and Countdown use Loom's exact verifier on the last
boxed answer, else the last number / the last arithmetic expression anywhere in the text.
Pure: returns a ``Verdict`` or the ``MathItem`` a pool worker must check.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from loom.answers import last_boxed
from loom.contracts.rewards import AccuracyParams
from loom.contracts.wire import Contract, RewardStatus, TaskKind
from reward_svc.accuracy import plan, read_gold
from reward_svc.mathverify import MathItem, Verdict

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


def stated_answers(task: str, text: str, tail_chars: int) -> list[str]:
    """Every answer ``text`` states, for ``accuracy.plan``: the last boxed answer, else (countdown)
    each arithmetic expression with an operator, (arithmetic) each number, anywhere in the text."""
    boxed = last_boxed(text)
    if task == "countdown":
        cands = [boxed.split("=")[0]] if boxed is not None else expressions(text)
        return [c for c in cands if any(op in c for op in "+-*/")]
    return [boxed] if boxed is not None else _NUMBER.findall(text)


_PARAMS = AccuracyParams()  # math: the last boxed answer, else the tail with the last-number fallback


def plan_matches(req: MatchRequest) -> tuple[list[Verdict | None], list[tuple[int, MathItem]]]:
    task = req.task or "math"
    gold = read_gold(task, req.label, req.meta)  # once: the label and meta are shared by every text
    decided: list[Verdict | None] = []
    math: list[tuple[int, MathItem]] = []
    for i, text in enumerate(req.texts):
        p = plan(task, gold, text, _PARAMS, stated_answers)
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
