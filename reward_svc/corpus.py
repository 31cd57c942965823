"""Verification corpora shared by the tests and ``bench/reward.py``: a realistic mix of math answers
(right and wrong) and a hostile corpus. Deterministic (seeded)."""

from __future__ import annotations

import random

# (gold, answer latex that is right, answer latex that is wrong)
_CASES: list[tuple[str, str, str]] = [
    ("42", "42", "41"),
    ("\\frac{1}{2}", "0.5", "0.25"),
    ("0.75", "\\frac{3}{4}", "\\frac{2}{3}"),
    ("2\\sqrt{3}", "\\sqrt{12}", "3\\sqrt{2}"),
    ("x^2 + 2x + 1", "(x+1)^2", "(x-1)^2"),
    ("(1, 3]", "(1,3]", "[1,3]"),
    ("\\{1, 2, 3\\}", "\\{3, 2, 1\\}", "\\{1, 2\\}"),
    ("\\frac{\\pi}{4}", "\\frac{\\pi}{4}", "\\frac{\\pi}{3}"),
    ("-7", "-7", "7"),
    ("3x - 5", "-5 + 3x", "3x + 5"),
    ("[-2, \\infty)", "[-2,\\infty)", "(-2,\\infty)"),
    ("10\\%", "10", "11"),
]

_FILLER = (
    "Let us reason step by step. We expand the expression and collect the terms; "
    "then we check the boundary cases carefully. "
)


def realistic_mix(n: int, seed: int = 0) -> list[tuple[str, str, bool]]:
    """``n`` (gold, response, expected correct) with long reasoning before a boxed answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        gold, right, wrong = rng.choice(_CASES)
        ok = rng.random() < 0.5
        reasoning = _FILLER * rng.choice([2, 10, 40, 70])  # up to ~8.5k characters
        answer = right if ok else wrong
        response = f"<think>{reasoning}</think> First guess \\boxed{{0}}, finally \\boxed{{{answer}}}."
        out.append((gold, response, ok))
    return out


def frac_nest(depth: int) -> str:
    s = "1"
    for _ in range(depth):
        s = "\\frac{" + s + "}{" + s + "}"
    return s


def hostile() -> list[tuple[str, str]]:
    """(name, response) pairs; the gold is "42" for all of them."""
    return [
        ("tower of exponents", "\\boxed{9^{9^{9^{9}}}}"),
        ("power tower 10", "\\boxed{10^{10^{10}}}"),
        ("huge factorial", "\\boxed{(10^9)!}"),
        ("huge power", "\\boxed{2^{10^{10}}}"),
        ("long sum", "\\boxed{\\sum_{k=1}^{1000000} \\frac{1}{k}}"),
        ("integral", "\\boxed{\\int_0^1 x^{1000000} dx}"),
        ("deep frac nesting", "\\boxed{" + frac_nest(20) + "}"),
        ("frac nesting at the limit", "\\boxed{" + frac_nest(5) + "}"),
        ("100k characters then 42", "a" * 100_000 + " \\boxed{42}"),
        ("100k of 1+", "1+" * 50_000),
        ("unbalanced braces", "\\boxed{{{{{42}" + "}" * 3 + "{" * 500),
        ("control characters", "\x00\x01\x02\x1b[31m \\boxed{\x00 42\x07}"),
        ("python injection", "\\boxed{__import__('os').system('echo pwned')}"),
        ("emoji", "🙂" * 1000 + " \\boxed{🙂}"),
    ]
