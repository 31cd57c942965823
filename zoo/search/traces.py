"""Countdown search traces: the search written out move by move, with backtracking, in the
plain, reflect, stream and spawn formats Loom serves. The prompts, markers, spawn syntax and parsers
are the tiny model's (zoo/tiny/traces.py), so every mode runs both models unchanged; what differs is
the reasoning: the tiny model writes the gold steps, this one searches for them.

One line per first move tried (APR's depth-first search over Countdown, docs/algorithms.md §2.4 and
docs/models.md, with the last level folded into the line): the move, the two numbers left (larger
first), the values of
``+ - * /`` on them (``-`` where the division is not exact), then ``no`` and the next move (the
backtrack), or ``yes`` and the move that reaches the target::

    [plain] Use 3 5 7 to make 22.
    <think> 22:[3,5,7]
    7-3=4 [5,4] 9 1 20 - no
    5*3=15 [15,7] 22 8 105 - yes 15+7=22
    </think> \\boxed{(5*3)+7}

The order of the moves is drawn per trace (seeded by the problem), so a sampled search explores them
in different orders; the search is complete (every first move, every way to finish), so it always
reaches a solution of a solvable problem.

Spawn (APR's spawn/join): the parent spawns one child per pair of numbers, each child searches the
moves on its pair the same way and returns the solution's moves or ``No solution``::

    parent  <think> 22:[3,5,7]\\n<Calling Sub Searches>\\n<Start Sub Search 0 at level 1> Moving to
            Node #0 22:[5,3] 7\\n...<End Calling Sub Searches>
    child   [child] 22:[5,3] 7\\n  ->  <think> 5+3=8 [8,7] 15 1 56 - no\\n5*3=15 [15,7] 22 8 105 - yes
            15+7=22 </think> 5*3=15 15+7=22
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, FORCED_ENDING, Markers, SpawnSyntax
from zoo.tiny.tasks import Problem, _apply
from zoo.tiny.traces import (
    Piece,
    SpawnTrace,
    _state,
    boxed,
    child_prompt,
    countdown_rechecks,
    expression_from_steps,
    plain_prompt,
    reflect_prompt,
    spawn_parent,
    stream_connector,
)
from zoo.tiny.traces import _stream_units as stream_units
from zoo.tiny.traces import plain_trace as arith_plain_trace
from zoo.tiny.traces import stream_trace as arith_stream_trace

FORMATS = ("plain", "reflect", "stream", "spawn")
OPS = "+-*/"


@dataclass(frozen=True)
class Style:
    """How a search is written. ``shuffle``: moves in a drawn order (else the fixed order of
    :func:`moves`: pairs left to right, ``+ - * /``); ``echo_target``: the target is written before
    the verdict (``... 22? yes``), so the model compares two adjacent numbers. The shipped model was
    trained on ``DRAWN`` first, then on ``FIXED`` (zoo/search/train.py); it writes ``FIXED``."""

    shuffle: bool
    echo_target: bool


DRAWN = Style(shuffle=True, echo_target=False)
FIXED = Style(shuffle=False, echo_target=True)


@dataclass(frozen=True)
class Move:
    x: int
    op: str
    y: int
    r: int
    rest: tuple[int, int]  # the two numbers left, larger first

    @property
    def step(self) -> str:
        return f"{self.x}{self.op}{self.y}={self.r}"


def moves(pool: list[int] | tuple[int, ...], pairs: list[tuple[int, int]] | None = None) -> list[Move]:
    """Every first move on a pool of three (x >= y, one per distinct (x, op, y)), optionally only
    on the index ``pairs``."""
    out, seen = [], set()
    pairs = pairs if pairs is not None else [(0, 1), (0, 2), (1, 2)]
    for i, j in pairs:
        x, y = max(pool[i], pool[j]), min(pool[i], pool[j])
        (k,) = (n for n in range(3) if n not in (i, j))
        for op in OPS:
            r = _apply(x, op, y)
            if r is None or (x, op, y) in seen:
                continue
            seen.add((x, op, y))
            a, b = max(r, pool[k]), min(r, pool[k])
            out.append(Move(x, op, y, r, (a, b)))
    return out


def finish(target: int, rest: tuple[int, int]) -> str | None:
    """The last move reaching ``target`` from the two numbers left (larger first), or None."""
    a, b = rest
    for op in OPS:
        if _apply(a, op, b) == target:
            return f"{a}{op}{b}={target}"
    return None


def search_line(target: int, m: Move, style: Style = FIXED) -> str:
    a, b = m.rest
    values = " ".join(str(v) if (v := _apply(a, op, b)) is not None else "-" for op in OPS)
    last = finish(target, m.rest)
    verdict = f"yes {last}" if last else "no"
    echo = f" {target}?" if style.echo_target else ""
    return f"{m.step} [{a},{b}] {values}{echo} {verdict}"


def search(target: int, ordered: list[Move], style: Style = FIXED) -> tuple[list[str], list[str] | None]:
    """Lines of the search over ``ordered`` up to the first success, and the solution's steps."""
    lines = []
    for m in ordered:
        lines.append(search_line(target, m, style))
        last = finish(target, m.rest)
        if last:
            return lines, [m.step, last]
    return lines, None


def search_lines(problem: Problem, rng: random.Random, style: Style = FIXED) -> tuple[list[str], list[str]]:
    """The header, the search lines in a drawn order, and the solution (a solvable problem always has one)."""
    order = moves(problem.numbers)
    if style.shuffle:
        rng.shuffle(order)
    lines, solution = search(problem.target, order, style)
    if solution is None:
        raise ValueError(f"{problem.text}: no solution (not a generated problem?)")
    return [_state(problem.target, problem.numbers), *lines], solution


def _rng(problem: Problem, variant: int) -> random.Random:
    return random.Random(f"{problem.key}/search/{variant}")


def plain_trace(problem: Problem, variant: int = 0, style: Style = FIXED) -> list[Piece]:
    if problem.kind == "arith":
        return arith_plain_trace(problem)
    lines, solution = search_lines(problem, _rng(problem, variant), style)
    body = "\n".join(lines)
    return [
        Piece(plain_prompt(problem), False),
        Piece(f"<think> {body}\n</think> {boxed(expression_from_steps(solution))}", True),
    ]


def rechecks(problem: Problem, answer: str, steps: Sequence[str]) -> list[str]:
    """The re-checks of a stated answer (the reflect format's pool; zoo/search/reflect.py too): the
    tiny model's pool, the first one replaying the search's steps."""
    return countdown_rechecks(problem, answer, " ".join(steps))


def reflect_trace(
    problem: Problem, variant: int = 0, checks: tuple[int, int] = (1, 3), style: Style = FIXED
) -> list[Piece]:
    """The search, the answer stated, then ``checks`` re-checks before the forced ending."""
    rng = _rng(problem, variant)
    lines, solution = search_lines(problem, rng, style)
    answer = expression_from_steps(solution)
    pool = rechecks(problem, answer, solution)
    rng.shuffle(pool)
    picked = [pool[i % len(pool)] for i in range(rng.randint(*checks))]
    think = "\n\n".join(["\n".join(lines) + f"\nSo the answer is {answer}.", *picked])
    return [
        Piece(reflect_prompt(problem), False),
        Piece(f"<think> {think}{FORCED_ENDING}{boxed(answer)}", True),
    ]


def stream_trace(
    problem: Problem, variant: int = 0, markers: Markers = DEFAULT_MARKERS, style: Style = FIXED
) -> list[Piece]:
    """The tiny model's streaming units, then the search as the deep phase."""
    if problem.kind == "arith":
        return arith_stream_trace(problem, markers)
    pieces = [Piece("[stream]", False)]
    for sentence, thought in stream_units(problem, random.Random(problem.key)):
        pieces.append(Piece(f" {sentence}{markers.sentence_end}", False))
        pieces.append(
            Piece(f" {thought}{markers.thought_end}" if thought else markers.skip + markers.thought_end, True)
        )
    pieces.append(Piece(stream_connector(markers), False))
    lines, solution = search_lines(problem, _rng(problem, variant), style)
    deep = "\n".join(lines[1:])
    answer = boxed(expression_from_steps(solution))
    pieces.append(Piece(f" {deep}{markers.reasoning_end} {answer}{markers.answer_end}", True))
    return pieces


def child_message_of(target: int, x: int, y: int, z: int) -> str:
    """A child's spawn message: its pair (larger first), the number left, the target."""
    return f"{target}:[{max(x, y)},{min(x, y)}] {z}"


def child_trace(
    target: int, x: int, y: int, z: int, rng: random.Random, style: Style = FIXED
) -> tuple[list[Piece], str]:
    """A child's search over the moves on its pair, and its returned message."""
    order = moves((x, y, z), pairs=[(0, 1)])
    if style.shuffle:
        rng.shuffle(order)
    lines, solution = search(target, order, style)
    ret = " ".join(solution) if solution else DEFAULT_SPAWN.no_solution
    body = "\n".join(lines)
    return [
        Piece(child_prompt(child_message_of(target, x, y, z)), False),
        Piece(f"<think> {body} </think> {ret}", True),
    ], ret


def spawn_trace(
    problem: Problem, variant: int = 0, syntax: SpawnSyntax = DEFAULT_SPAWN, style: Style = FIXED
) -> SpawnTrace:
    """One child per pair of numbers (in a drawn order); the parent answers from the first child
    that returned a solution."""
    assert problem.kind == "countdown" and len(problem.numbers) == 3
    rng = _rng(problem, variant)
    pool = problem.numbers
    pairs = [(0, 1), (0, 2), (1, 2)]
    if style.shuffle:
        rng.shuffle(pairs)
    spawn_lines, children, messages, solution = [], [], [], None
    for i, (a, b) in enumerate(pairs):
        (k,) = (n for n in range(3) if n not in (a, b))
        x, y, z = pool[a], pool[b], pool[k]
        spawn_lines.append(
            syntax.spawn_child.format(i=i, node=i) + " " + child_message_of(problem.target, x, y, z)
        )
        pieces, ret = child_trace(problem.target, x, y, z, rng, style)
        children.append(pieces)
        messages.append(ret)
        if solution is None and ret != syntax.no_solution:
            solution = ret.split()
    if solution is None:
        raise ValueError(f"{problem.text}: no child found a solution")
    parent = spawn_parent(problem, pool, spawn_lines, messages, solution, syntax)
    return SpawnTrace(parent=parent, children=children, messages=messages)


def build_trace(problem: Problem, fmt: str, variants: int = 1, style: Style = FIXED) -> list[list[Piece]]:
    """Training sequences for ``problem`` in ``fmt``: ``variants`` search orders (spawn: the parent
    and every child of each; the re-checks of reflect still vary with a fixed order)."""
    out: list[list[Piece]] = []
    for v in range(variants):
        if fmt == "plain":
            out.append(plain_trace(problem, v, style))
        elif fmt == "reflect":
            out.append(reflect_trace(problem, v, checks=(1, 3) if v % 2 == 0 else (0, 1), style=style))
        elif fmt == "stream":
            out.append(stream_trace(problem, v, style=style))
        elif fmt == "spawn":
            t = spawn_trace(problem, v, style=style)
            out.extend([t.parent, *t.children])
        else:
            raise ValueError(f"unknown format {fmt!r}")
    return out
