"""Accuracy (docs/algorithms.md §1.1; AdaSR §3.2 ``R_acc = 1[â = a]``): binary, per trajectory.

``read_gold`` reads the group's gold answer once; ``plan`` decides each trajectory without
math-verify where it can (choice / short answer, Loom's exact Countdown and arithmetic verifier) and
otherwise returns the ``MathItem`` that a verification worker must check; the accuracy component
then reads the verdicts from the context. Every step is linear in the text: planning runs in the
API's event loop.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from loom.answers import last_boxed
from loom.contracts.rewards import ANSWER_TAIL_CHARS, AccuracyParams
from loom.exact import ExprError, check_countdown, evaluate, parse_countdown, parse_number
from reward_svc.context import GroupContext, reads
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.trace import answer_region

Gold = tuple[list[int], int] | Fraction | str  # countdown (numbers, target), arithmetic value, label

_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
# Possessive quantifiers and a cue that starts no ASCII word midway keep the scan linear: the
# plain ``\s*(?:is|:)?\s*[:(\s]*`` backtracked cubically on "answer" + spaces. The cue is a whole
# word: "the answers are (C)" is not the cue "answer" with the choice "s".
_CHOICE_CUE = re.compile(
    r"(?<![A-Za-z])(?:answer|choice|option)(?![A-Za-z])(?:\s*+is)?[:(\s]*+([A-Za-z]++)(?!\w)", re.IGNORECASE
)
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


def read_gold(task: str, label: str | None, meta: dict[str, Any]) -> Gold | Verdict:
    """The gold answer in the form ``task`` compares with, or the verdict for every trajectory.
    Read once per group: a label can be as long as a response."""
    if task == "countdown":
        gold = parse_countdown(label if "numbers" not in meta and label else meta)
        if gold is None:
            return Verdict("invalid", detail="countdown needs meta/label with numbers and target")
        return gold
    if label is None or not label.strip():
        return Verdict("invalid", detail="group has no label")
    if task == "arithmetic":
        value = parse_number(label)
        return Verdict("invalid", detail="label is not a number") if value is None else value
    if task == "choice":
        return normalise_choice(label)
    return label


# The exact tasks' answer candidates in a text, in order (the last is tried first): the trajectory's
# final answer here, any stated answer for the ``gold`` detector (reward_svc.match).
Candidates = Callable[[str, str, int], list[str]]


def final_answer(task: str, text: str, tail_chars: int) -> list[str]:
    """The last boxed answer, else the last non-empty line of the tail (countdown and arithmetic)."""
    boxed = last_boxed(text)
    if boxed is not None:
        return [boxed]
    lines = [ln for ln in text[-tail_chars:].splitlines() if ln.strip()]
    return lines[-1:]


def plan(
    task: str,
    gold: Gold | Verdict,
    text: str | None,
    params: AccuracyParams,
    candidates: Candidates = final_answer,
) -> Verdict | MathItem:
    """One text's verdict, or the math item to verify; ``gold`` is ``read_gold``'s. Countdown takes
    the last candidate that is an arithmetic expression, arithmetic the last candidate."""
    if text is None:
        return Verdict("invalid", detail="trajectory has no text")
    if isinstance(gold, Verdict):
        return gold
    if task == "countdown":
        assert isinstance(gold, tuple)
        cands = candidates(task, text, params.tail_chars)
        if not cands:
            return Verdict("no_answer")
        for c in reversed(cands):
            try:
                evaluate(c.split("=")[0])
            except ExprError:
                continue
            return Verdict("ok", correct=check_countdown(c, gold[0], gold[1]))
        return Verdict("parse_error", detail="not an arithmetic expression")
    if task == "arithmetic":
        cands = candidates(task, text, params.tail_chars)
        if not cands:
            return Verdict("no_answer")
        value = parse_number(cands[-1])
        if value is None:
            return Verdict("parse_error", detail="not a number")
        return Verdict("ok", correct=value == gold)
    if task == "choice":
        choice = extract_choice(text, params.tail_chars)
        if choice is None:
            return Verdict("no_answer")
        return Verdict("ok", correct=normalise_choice(choice) == gold)
    assert isinstance(gold, str)
    kind, region = answer_region(text, params.tail_chars)
    return MathItem(gold=gold, kind=kind, region=region, number_fallback=params.number_fallback)


@reads("accuracy")
def accuracy(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """R_acc = 1[â = a] (AdaSR §3.2); 0 for any trajectory whose status is not ``ok``."""
    AccuracyParams.model_validate(params)
    return list(ctx.accuracy())
