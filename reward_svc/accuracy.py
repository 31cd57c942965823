"""Accuracy (ALGORITHMS.md 1.1; AdaSR §3.2 ``R_acc = 1[â = a]``): binary, per trajectory.

``plan`` decides each trajectory without math-verify where it can (choice / short answer, Loom's
exact Countdown and arithmetic verifier) and otherwise returns the ``MathItem`` that a verification
worker must check; the accuracy component then reads the verdicts from the context.
"""

from __future__ import annotations

import json
import re
from typing import Any

from loom.exact import ExprError, check_arithmetic, check_countdown, evaluate, parse_number
from loom.schemas import Group, TaskKind, Trajectory
from reward_svc.context import GroupContext, Params
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.trace import ANSWER_TAIL_CHARS, answer_region, last_boxed


class AccuracyParams(Params):
    task: TaskKind | None = None  # overrides the group's task; default math
    number_fallback: bool = True  # unboxed answers: the last number of the tail
    tail_chars: int = ANSWER_TAIL_CHARS


_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_CHOICE_CUE = re.compile(r"(?:answer|choice|option)\s*(?:is|:)?\s*[:(\s]*([A-Za-z]+)\b", re.IGNORECASE)
_LAST_CHOICE = re.compile(r"\(([A-Ea-e])\)|\b([A-E])\b")


def normalise_choice(text: str) -> str:
    text = _TEXT_WRAP.sub(r"\1", text)
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def extract_choice(text: str, tail_chars: int = ANSWER_TAIL_CHARS) -> str | None:
    """The chosen option / short answer: last boxed answer, else an "answer is X" cue, else the last
    standalone option letter in the tail."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    tail = text[-tail_chars:]
    cues = _CHOICE_CUE.findall(tail)
    if cues:
        return str(cues[-1])
    letters = _LAST_CHOICE.findall(tail)
    if letters:
        a, b = letters[-1]
        return a or b
    return None


def _countdown_gold(group: Group) -> tuple[list[int], int] | None:
    source: Any = group.meta
    if "numbers" not in source and group.label:
        try:
            source = json.loads(group.label)
        except ValueError:
            return None
    try:
        numbers = [int(n) for n in source["numbers"]]
        return numbers, int(source["target"])
    except (KeyError, TypeError, ValueError):
        return None


def _exact_answer(text: str, tail_chars: int) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = [ln for ln in text[-tail_chars:].splitlines() if ln.strip()]
    return lines[-1] if lines else None


def plan(group: Group, traj: Trajectory, params: AccuracyParams) -> Verdict | MathItem:
    task = params.task or group.task or "math"
    text = traj.text
    if text is None:
        return Verdict("invalid", detail="trajectory has no text")
    if task == "countdown":
        gold = _countdown_gold(group)
        if gold is None:
            return Verdict("invalid", detail="countdown needs meta/label with numbers and target")
        answer = _exact_answer(text, params.tail_chars)
        if answer is None:
            return Verdict("no_answer")
        try:
            evaluate(answer.split("=")[0])
        except ExprError:
            return Verdict("parse_error", detail="not an arithmetic expression")
        return Verdict("ok", correct=check_countdown(answer, gold[0], gold[1]))
    if group.label is None or not group.label.strip():
        return Verdict("invalid", detail="group has no label")
    if task == "arithmetic":
        answer = _exact_answer(text, params.tail_chars)
        if answer is None:
            return Verdict("no_answer")
        if parse_number(answer) is None:
            return Verdict("parse_error", detail="not a number")
        return Verdict("ok", correct=check_arithmetic(answer, group.label))
    if task == "choice":
        choice = extract_choice(text, params.tail_chars)
        if choice is None:
            return Verdict("no_answer")
        return Verdict("ok", correct=normalise_choice(choice) == normalise_choice(group.label))
    kind, region = answer_region(text, params.tail_chars)
    return MathItem(gold=group.label, kind=kind, region=region, number_fallback=params.number_fallback)


def accuracy(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """R_acc = 1[â = a] (AdaSR §3.2); 0 for any trajectory whose status is not ``ok``."""
    AccuracyParams.model_validate(params)
    return list(ctx.accuracy())
