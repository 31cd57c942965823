"""Exact verification of arithmetic answers without evaluating model output as Python.

Model output is untrusted text. Expressions are parsed by a small recursive-descent parser over
integers, ``+ - * /`` (also ``x`` ``×`` ``÷`` ``−``) and parentheses, and evaluated with exact
fractions. Size limits bound the work: an over-long or over-deep expression is rejected, never run.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

MAX_EXPR_CHARS = 512
MAX_DEPTH = 32
MAX_DIGITS = 30
MAX_NUMBER_CHARS = 600  # a plain final answer (parse_number); an expression's literals: MAX_DIGITS

_TOKEN = re.compile(r"\s*(\d+|[-+*/()])")
_NORMALISE = str.maketrans({"×": "*", "x": "*", "X": "*", "÷": "/", "−": "-", "–": "-", "·": "*"})


class ExprError(ValueError):
    """The text is not a well-formed arithmetic expression within the limits."""


@dataclass(frozen=True)
class Evaluated:
    value: Fraction
    numbers: tuple[int, ...]  # every integer literal, in order of appearance


def tokenize(text: str) -> list[str]:
    text = text.translate(_NORMALISE).strip()
    if len(text) > MAX_EXPR_CHARS:
        raise ExprError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            if text[pos:].strip() == "":
                break
            raise ExprError(f"unexpected character {text[pos]!r} at {pos}")
        tok = m.group(1)
        if tok.isdigit() and len(tok) > MAX_DIGITS:
            raise ExprError("number too long")
        tokens.append(tok)
        pos = m.end()
    if not tokens:
        raise ExprError("empty expression")
    return tokens


def evaluate(text: str) -> Evaluated:
    """Evaluate ``text`` exactly; raises ExprError on malformed input or division by zero."""
    tokens = tokenize(text)
    numbers: list[int] = []
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise ExprError("unexpected end of expression")
        pos += 1
        return tokens[pos - 1]

    def expr(depth: int) -> Fraction:
        value = term(depth)
        while peek() in ("+", "-"):
            op = take()
            rhs = term(depth)
            value = value + rhs if op == "+" else value - rhs
        return value

    def term(depth: int) -> Fraction:
        value = factor(depth)
        while peek() in ("*", "/"):
            op = take()
            rhs = factor(depth)
            if op == "*":
                value = value * rhs
            else:
                if rhs == 0:
                    raise ExprError("division by zero")
                value = value / rhs
        return value

    def factor(depth: int) -> Fraction:
        if depth > MAX_DEPTH:
            raise ExprError("expression nested too deeply")
        tok = take()
        if tok == "(":
            value = expr(depth + 1)
            if take() != ")":
                raise ExprError("missing ')'")
            return value
        if tok == "-":
            return -factor(depth + 1)
        if tok.isdigit():
            numbers.append(int(tok))
            return Fraction(int(tok))
        raise ExprError(f"unexpected token {tok!r}")

    value = expr(0)
    if pos != len(tokens):
        raise ExprError(f"unexpected token {tokens[pos]!r}")
    return Evaluated(value=value, numbers=tuple(numbers))


def parse_number(text: str) -> Fraction | None:
    """A final numeric answer: integer, decimal, fraction ``a/b`` or a small expression; None for
    anything else, a number longer than ``MAX_NUMBER_CHARS`` included."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if re.fullmatch(r"-?\d+(\.\d+)?", cleaned):
        # under 640 characters, int() never meets Python's digit limit, whatever it is set to
        return Fraction(cleaned) if len(cleaned) <= MAX_NUMBER_CHARS else None
    try:
        return evaluate(cleaned).value
    except ExprError:
        return None


def check_arithmetic(answer: str, gold: str) -> bool:
    """True when the answer's value equals the gold value exactly."""
    a, g = parse_number(answer), parse_number(gold)
    return a is not None and g is not None and a == g


def parse_countdown(spec: Any) -> tuple[list[int], int] | None:
    """A Countdown problem, ``{"numbers": [...], "target": n}`` as a mapping or as JSON text:
    ``(numbers, target)``, or None when it is malformed (never an exception: labels are input)."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past the stack
            return None
    try:
        return [int(n) for n in spec["numbers"]], int(spec["target"])
    except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        return None


def check_countdown(expression: str, numbers: list[int], target: int, *, use_all: bool = True) -> bool:
    """Countdown: ``expression`` reaches ``target`` using each given number at most once (exactly
    once when ``use_all``). The expression may be written ``<expr> = <target>``."""
    left = expression.split("=")[0]
    try:
        ev = evaluate(left)
    except ExprError:
        return False
    used, have = Counter(ev.numbers), Counter(numbers)
    if any(used[n] > have[n] for n in used):
        return False
    if use_all and used != have:
        return False
    return ev.value == target
