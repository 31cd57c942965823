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

from loom.exact import ExprError, check_arithmetic, check_countdown, evaluate
from loom.schemas import Contract, Group, RewardStatus, TaskKind
from reward_svc.accuracy import _countdown_gold, extract_choice, normalise_choice
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.trace import ANSWER_TAIL_CHARS, last_boxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_EXPR = re.compile(r"[\d()][\d\s()+\-*/]*[\d)]")


class MatchRequest(Contract):
    label: str | None = Field(default=None, max_length=10_000, description="gold answer")
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


def plan_match(req: MatchRequest, text: str) -> Verdict | MathItem:
    task = req.task or "math"
    boxed = last_boxed(text)
    if task == "countdown":
        gold = _countdown_gold(Group(id="match", label=req.label, meta=req.meta))
        if gold is None:
            return Verdict("invalid", detail="countdown needs meta/label with numbers and target")
        cands = [boxed.split("=")[0]] if boxed is not None else [m.group(0) for m in _EXPR.finditer(text)]
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
    if req.label is None or not req.label.strip():
        return Verdict("invalid", detail="no gold answer")
    if task == "arithmetic":
        answer = boxed if boxed is not None else (_NUMBER.findall(text) or [None])[-1]
        if answer is None:
            return Verdict("no_answer")
        return Verdict("ok", correct=check_arithmetic(answer, req.label))
    if task == "choice":
        choice = extract_choice(text)
        if choice is None:
            return Verdict("no_answer")
        return Verdict("ok", correct=normalise_choice(choice) == normalise_choice(req.label))
    if boxed is not None:
        return MathItem(gold=req.label, kind="boxed", region=boxed)
    return MathItem(gold=req.label, kind="tail", region=text[-ANSWER_TAIL_CHARS:], number_fallback=True)


def plan_matches(req: MatchRequest) -> tuple[list[Verdict | None], list[tuple[int, MathItem]]]:
    decided: list[Verdict | None] = []
    math: list[tuple[int, MathItem]] = []
    for i, text in enumerate(req.texts):
        p = plan_match(req, text)
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
