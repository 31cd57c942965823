"""Small generated programming problems with tests (the code model's tasks; docs/models.md).

A problem asks for one Python function built from three parts, each with its words, its code and its
meaning (a Python function of the generator, never the code string run):

- a **source**: the list ``xs`` (``f(xs)``), the numbers ``1..n`` (``f(n)``) or the string ``s``
  (``f(s)``);
- a **filter** on its elements: even, odd, greater than k, less than k, divisible by k (numbers);
  vowels, consonants, digits, the letter c (strings); or none;
- a **map** (times k, plus k, minus k, squared; upper case, doubled) and a **result**: the list
  itself, reversed or sorted, its sum, count or largest value (numbers), the joined string, reversed,
  or the count (strings).

For example ``Write f(xs): return the sum of the even numbers of xs times 3.`` with the reference
``def f(xs):\\n    return sum([x * 3 for x in xs if x % 2 == 0])``. A problem's tests are
``TESTS`` assert lines (``assert f([4, -1, 6]) == 30``) on inputs drawn from its own key, their
expected values computed by the parts' meanings, in the code reward's label form (reward_svc/code.py:
``{"asserts": [...]}``). Held-out split: the hash of the statement (zoo.tiny.tasks' rule), so a
held-out problem is a composition no training problem states, made of parts training has seen.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

Source = Literal["list", "range", "string"]
Split = Literal["train", "test", "any"]
SOURCES: tuple[Source, ...] = ("list", "range", "string")
TEST_BUCKETS = 10  # 1 in TEST_BUCKETS problems is held out
TESTS = 4  # assert lines per problem (code_pass moves in quarters)
HELDOUT_SEED = 10_000  # the card's held-out sets: code_problems(n, HELDOUT_SEED, "test")
VOWELS = "aeiou"


@dataclass(frozen=True)
class Part:
    """One part of a problem: its words, its code and its meaning."""

    words: str
    code: str
    fn: Callable[..., Any]


@dataclass(frozen=True)
class CodeProblem:
    source: Source
    text: str  # the statement, e.g. "Write f(xs): return the even numbers of xs doubled."
    solution: str  # the reference function (its source)
    asserts: tuple[str, ...]  # its tests

    @property
    def key(self) -> str:
        return self.text

    @property
    def label(self) -> str:
        """The tests as the code reward reads them (reward_svc/code.py)."""
        return json.dumps({"asserts": list(self.asserts)})


def _num_filters(rng: random.Random) -> Part:
    k = rng.randint(2, 9)
    return rng.choice(
        [
            Part("", "", lambda x: True),
            Part("even", "x % 2 == 0", lambda x: x % 2 == 0),
            Part("odd", "x % 2 == 1", lambda x: x % 2 == 1),
            Part(f"greater than {k}", f"x > {k}", lambda x: x > k),
            Part(f"less than {k}", f"x < {k}", lambda x: x < k),
            Part(f"divisible by {k}", f"x % {k} == 0", lambda x: x % k == 0),
        ]
    )


def _num_maps(rng: random.Random) -> Part:
    k = rng.randint(2, 9)
    return rng.choice(
        [
            Part("", "x", lambda x: x),
            Part(f" times {k}", f"x * {k}", lambda x: x * k),
            Part(f" plus {k}", f"x + {k}", lambda x: x + k),
            Part(f" minus {k}", f"x - {k}", lambda x: x - k),
            Part(" squared", "x * x", lambda x: x * x),
        ]
    )


NUM_RESULTS = (
    Part("{q}", "[{e}]", list),
    Part("{q}, reversed", "[{e}][::-1]", lambda v: v[::-1]),
    Part("{q}, sorted", "sorted([{e}])", sorted),
    Part("the sum of {q}", "sum([{e}])", sum),
    Part("the count of {q}", "len([{e}])", len),
    Part("the largest of {q} (0 if none)", "max([{e}], default=0)", lambda v: max(v, default=0)),
)


def _str_filters(rng: random.Random) -> Part:
    ch = rng.choice("abdepqstxz")
    return rng.choice(
        [
            Part("characters", "", lambda c: True),
            Part("vowels", f'c in "{VOWELS}"', lambda c: c in VOWELS),
            Part(
                "consonants",
                f'c.isalpha() and c not in "{VOWELS}"',
                lambda c: c.isalpha() and c not in VOWELS,
            ),
            Part("digits", "c.isdigit()", lambda c: c.isdigit()),
            Part(f"letters {ch}", f'c == "{ch}"', lambda c: c == ch),
        ]
    )


def _str_maps(rng: random.Random) -> Part:
    k = rng.randint(2, 4)
    return rng.choice(
        [
            Part("", "c", lambda c: c),
            Part(" in upper case", "c.upper()", lambda c: c.upper()),
            Part(f" repeated {k} times", f"c * {k}", lambda c: c * k),
        ]
    )


STR_RESULTS = (
    Part("the {q}", '"".join([{e}])', "".join),
    Part("the {q}, reversed", '"".join([{e}][::-1])', lambda v: "".join(v[::-1])),
    Part("the number of {q}", "len([{e}])", len),
)
LETTERS = "abcdeiopqstxyz0123"


def _number_problem(rng: random.Random, source: Source) -> tuple[str, str, str, Callable[[Any], Any]]:
    """(argument, statement's phrase, return expression, meaning) of a list or range problem."""
    filt, result = _num_filters(rng), rng.choice(NUM_RESULTS)
    fmap = Part("", "x", lambda x: x) if result.code.startswith("len") else _num_maps(rng)
    arg, of, src = ("xs", "of xs", "xs") if source == "list" else ("n", "from 1 to n", "range(1, n + 1)")
    adjective = filt.words in ("even", "odd")
    q = f"the {filt.words} numbers {of}" if adjective else f"the numbers {of} {filt.words}".rstrip()
    e = f"{fmap.code} for x in {src}" + (f" if {filt.code}" if filt.code else "")

    def meaning(v: Any) -> Any:
        xs = v if source == "list" else range(1, v + 1)
        return result.fn([fmap.fn(x) for x in xs if filt.fn(x)])

    return arg, result.words.format(q=q + fmap.words), result.code.format(e=e), meaning


def _string_problem(rng: random.Random) -> tuple[str, str, str, Callable[[Any], Any]]:
    filt, result = _str_filters(rng), rng.choice(STR_RESULTS)
    fmap = Part("", "c", lambda c: c) if result.code.startswith("len") else _str_maps(rng)
    e = f"{fmap.code} for c in s" + (f" if {filt.code}" if filt.code else "")

    def meaning(s: str) -> Any:
        return result.fn([fmap.fn(c) for c in s if filt.fn(c)])

    return "s", result.words.format(q=f"{filt.words} of s{fmap.words}"), result.code.format(e=e), meaning


def _inputs(rng: random.Random, source: Source) -> Any:
    if source == "list":
        return [rng.randint(-5, 15) for _ in range(rng.randint(0, 7))]
    if source == "range":
        return rng.randint(0, 12)
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(0, 9)))


Drawn = tuple[str, str, str, Callable[[Any], Any]]  # (argument, statement, return expression, meaning)


def _draw(rng: random.Random, source: Source) -> Drawn:
    arg, words, expr, meaning = _string_problem(rng) if source == "string" else _number_problem(rng, source)
    return arg, f"Write f({arg}): return {words}.", expr, meaning


def _with_tests(source: Source, drawn: Drawn) -> CodeProblem:
    """The problem of a drawn statement; its tests are drawn from the statement itself, so a
    statement is always the same problem whichever seed drew it."""
    arg, text, expr, meaning = drawn
    tests_rng = random.Random(text)
    inputs: list[Any] = []
    for _ in range(50 * TESTS):
        if len(inputs) == TESTS:
            break
        v = _inputs(tests_rng, source)
        if v not in inputs:
            inputs.append(v)
    asserts = tuple(f"assert f({v!r}) == {meaning(v)!r}" for v in inputs)
    return CodeProblem(source, text, f"def f({arg}):\n    return {expr}\n", asserts)


def code_problem(rng: random.Random, source: Source) -> CodeProblem:
    """One problem of ``source``."""
    return _with_tests(source, _draw(rng, source))


def is_held_out(problem: CodeProblem) -> bool:
    return _held_out_text(problem.key)


def _held_out_text(text: str) -> bool:
    return hashlib.sha256(text.encode()).digest()[0] % TEST_BUCKETS == 0


def code_problems(
    n: int, seed: int, split: Split = "any", sources: tuple[Source, ...] = SOURCES
) -> list[CodeProblem]:
    """``n`` distinct problems from ``seed`` in ``split``, each of a source drawn from ``sources``
    (same arguments, same list)."""
    rng = random.Random(f"code:{seed}")
    out: list[CodeProblem] = []
    seen: set[str] = set()
    since_new = 0
    while len(out) < n:
        since_new += 1
        if since_new > 20_000:  # an exhausted space ends in well under a second
            raise ValueError(f"cannot draw {n} distinct code problems of {sources} (found {len(out)})")
        source = rng.choice(sources)
        drawn = _draw(rng, source)  # the statement first: its tests only once it is kept
        if drawn[1] in seen or (split != "any" and _held_out_text(drawn[1]) != (split == "test")):
            continue
        seen.add(drawn[1])
        out.append(_with_tests(source, drawn))
        since_new = 0
    return out


def code_prompt(problem: CodeProblem) -> str:
    """The code model's prompt: ``[code] <statement>`` and a newline (zoo/code/traces.py)."""
    return f"[code] {problem.text}\n"
