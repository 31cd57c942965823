"""Four-number Countdown search traces (APR's four-number problems): a search deep enough for spawn/join to
pay, written in the three-number model's line format (zoo/search/traces.py) one level further down.
The built-in model ``deep`` writes them (zoo/search/deep_train.py); ``bench/apr.py --gold-only
--numbers 4`` measures their path lengths and ``bench/apr.py --model deep --numbers 4`` the model's
accuracy against them (docs/benchmarks/apr.md).

The four numbers are written larger first and the first moves taken in that order (pairs
(0,1), (0,2), ... of the sorted pool, each operation once per distinct pair of values), the order
the three-number search uses on its own sorted pools. Serial search: one line per first move, marked
``>`` (the move and the three numbers left, larger first), then the three-number search of those
three, line by line as in zoo/search/traces.py, until one finishes::

    <think> 24:[8,5,3,2]
    > 8+5=13 [13,3,2]
    13+3=16 [16,2] 18 14 32 8 24? no
    ...
    > 8*3=24 [24,5,2]
    ...

A first move whose three numbers an earlier move already left (``9*1`` and ``9/1`` both leave
``[9,5,3]``) is skipped: each state is searched once. The trace ends in the solution's three steps on
one line and its expression built one substitution at a time (``substitution_chain`` of
zoo/tiny/traces.py), then the boxed answer::

    7+4=11 5*4=20 20+11=31
    20+11 = (5*4)+11 = (5*4)+(7+4)
    </think> \\boxed{(5*4)+(7+4)}

The order and the marker came from the first model trained on these traces (docs/models.md): with
the problem's own order of numbers and unmarked first-move lines, its greedy searches ran each
three-number search exactly but went wrong at the step from one pair to the next (the next pair of
the unsorted pool, or a sub-search line copied as if it were the last first move).

Spawn, two ways (``by``):

- ``pair``: one child per pair of numbers (six); a child tries the four operations on its pair, each
  followed by the three-number search of what is left, and returns the three steps or ``No solution``.
- ``move``: one child per first move (up to 24); a child runs the three-number search of what its
  move leaves, and returns the move and the two steps.

The parent's spawn block and join block are the three-number model's (zoo/tiny/traces.py
``spawn_parent``); its answer is the serial trace's ending above, from the first child that returned
a solution. The substitution chain came from the second model: it ran whole searches exactly and then
boxed a wrong expression for the steps it had found.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from loom.formats import DEFAULT_SPAWN, SpawnSyntax
from zoo.search.traces import FIXED, OPS, Style, moves, search
from zoo.tiny.tasks import Problem, Split, _apply, make_problems
from zoo.tiny.traces import (
    Piece,
    SpawnTrace,
    _state,
    boxed,
    child_prompt,
    plain_prompt,
    spawn_parent,
    substitution_chain,
)

DEEP_KNOBS: dict[str, object] = {"n_numbers": 4, "max_number": 9}
DEEP_MAX_SOLVING = 2  # first moves whose three-number search reaches the target
By = Literal["pair", "move"]


@dataclass(frozen=True)
class DeepMove:
    x: int
    op: str
    y: int
    r: int
    rest: tuple[int, int, int]  # the three numbers left, larger first

    @property
    def step(self) -> str:
        return f"{self.x}{self.op}{self.y}={self.r}"

    @property
    def line(self) -> str:
        a, b, c = self.rest
        return f"{FIRST} {self.step} [{a},{b},{c}]"


PAIRS4 = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
FIRST = ">"  # marks a serial search's first-move line


def larger_first(numbers: tuple[int, ...] | list[int]) -> list[int]:
    return sorted(numbers, reverse=True)


def deep_moves(
    pool: tuple[int, ...] | list[int], pairs: list[tuple[int, int]] | None = None
) -> list[DeepMove]:
    """Every first move on a pool of four (x >= y, one per distinct (x, op, y)), optionally only on
    the index ``pairs`` of the pool larger first."""
    pool = larger_first(pool)
    out: list[DeepMove] = []
    seen: set[tuple[int, str, int]] = set()
    states: set[tuple[int, int, int]] = set()
    for i, j in pairs if pairs is not None else PAIRS4:
        x, y = max(pool[i], pool[j]), min(pool[i], pool[j])
        left = [pool[k] for k in range(4) if k not in (i, j)]
        for op in OPS:
            r = _apply(x, op, y)
            if r is None or (x, op, y) in seen:
                continue
            a, b, c = sorted([r, *left], reverse=True)
            if (a, b, c) in states:  # a state an earlier move reached (9*1 and 9/1): searched once
                continue
            seen.add((x, op, y))
            states.add((a, b, c))
            out.append(DeepMove(x, op, y, r, (a, b, c)))
    return out


def answer_text(steps: list[str]) -> str:
    """A four-number trace's ending: the solution's steps on one line, its expression built by
    substitution on the next, then the boxed answer."""
    chain = substitution_chain(steps)
    return f"{' '.join(steps)}\n{' = '.join(chain)}\n</think> {boxed(chain[-1])}"


def sub_search(
    target: int, m: DeepMove, rng: random.Random, style: Style = FIXED
) -> tuple[list[str], list[str] | None]:
    """The three-number search of what ``m`` leaves: its lines and the two steps that finish, or None."""
    order = moves(m.rest)
    if style.shuffle:
        rng.shuffle(order)
    return search(target, order, style)


def deep_search(
    target: int, ordered: list[DeepMove], rng: random.Random, style: Style = FIXED
) -> tuple[list[str], list[str] | None]:
    """Lines of the two-level search over ``ordered`` up to the first success, and the three steps."""
    lines: list[str] = []
    for m in ordered:
        sub, found = sub_search(target, m, rng, style)
        lines += [m.line, *sub]
        if found is not None:
            return lines, [m.step, *found]
    return lines, None


def solving_first_moves(problem: Problem) -> int:
    rng = random.Random(0)
    return sum(sub_search(problem.target, m, rng)[1] is not None for m in deep_moves(problem.numbers))


def deep_problems(
    n: int, seed: int, split: Split = "any", max_solving: int = DEEP_MAX_SOLVING
) -> list[Problem]:
    """``n`` four-number Countdown problems with at most ``max_solving`` solving first moves (of about
    20), drawn as zoo.search.tasks draws three-number ones (same seeds, same held-out hash split)."""
    draw = 4 * n + 20
    while True:
        pool = make_problems("countdown", draw, seed, split, **DEEP_KNOBS)
        kept = [p for p in pool if 1 <= solving_first_moves(p) <= max_solving]
        if len(kept) >= n:
            return kept[:n]
        draw = int(draw * 1.5) + 10


def _rng(problem: Problem, variant: int) -> random.Random:
    return random.Random(f"{problem.key}/deep/{variant}")


def plain_trace(problem: Problem, variant: int = 0, style: Style = FIXED) -> list[Piece]:
    """The serial two-level search and the answer."""
    assert problem.kind == "countdown" and len(problem.numbers) == 4
    rng = _rng(problem, variant)
    order = deep_moves(problem.numbers)
    if style.shuffle:
        rng.shuffle(order)
    lines, solution = deep_search(problem.target, order, rng, style)
    if solution is None:
        raise ValueError(f"{problem.text}: no solution (not a generated problem?)")
    body = "\n".join([_state(problem.target, larger_first(problem.numbers)), *lines])
    return [Piece(plain_prompt(problem), False), Piece(f"<think> {body}\n{answer_text(solution)}", True)]


def _child(message: str, lines: list[str], ret: str) -> list[Piece]:
    return [Piece(child_prompt(message), False), Piece(f"<think> {chr(10).join(lines)} </think> {ret}", True)]


def spawn_trace(
    problem: Problem,
    variant: int = 0,
    by: By = "pair",
    syntax: SpawnSyntax = DEFAULT_SPAWN,
    style: Style = FIXED,
) -> SpawnTrace:
    """One child per pair (``by="pair"``) or per first move (``by="move"``); the parent answers from the
    first child that returned a solution."""
    assert problem.kind == "countdown" and len(problem.numbers) == 4
    rng = _rng(problem, variant)
    pool, target = larger_first(problem.numbers), problem.target
    jobs: list[tuple[str, list[DeepMove]]] = []
    if by == "pair":
        pairs = list(PAIRS4)
        if style.shuffle:
            rng.shuffle(pairs)
        for i, j in pairs:
            x, y = max(pool[i], pool[j]), min(pool[i], pool[j])
            c, d = sorted((pool[k] for k in range(4) if k not in (i, j)), reverse=True)
            ms = deep_moves(pool, pairs=[(i, j)])
            if ms:
                jobs.append((f"{target}:[{x},{y}] {c} {d}", ms))
    else:
        order = deep_moves(pool)
        if style.shuffle:
            rng.shuffle(order)
        jobs = [(f"{m.step} {_state(target, m.rest)}", [m]) for m in order]
    spawn_lines, children, messages, solution = [], [], [], None
    for i, (message, ms) in enumerate(jobs):
        spawn_lines.append(syntax.spawn_child.format(i=i, node=i) + " " + message)
        if by == "pair":
            lines, found = deep_search(target, ms, rng, style)
        else:
            lines, two = sub_search(target, ms[0], rng, style)
            found = [ms[0].step, *two] if two is not None else None
        ret = " ".join(found) if found else syntax.no_solution
        children.append(_child(message, lines, ret))
        messages.append(ret)
        if solution is None and found is not None:
            solution = found
    if solution is None:
        raise ValueError(f"{problem.text}: no child found a solution")
    parent = spawn_parent(problem, pool, spawn_lines, messages, solution, syntax, answer_text(solution))
    return SpawnTrace(parent=parent, children=children, messages=messages)
