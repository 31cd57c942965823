"""The search model's problems: three-number Countdown with few solving first moves, so the
written search has several steps before it finds one, and the tiny model's arithmetic.

``search_problems`` draws from zoo.tiny.tasks.make_problems (same seeds, same held-out hash split)
and keeps the Countdown problems with at most ``max_solving`` first moves that lead to the target.
"""

from __future__ import annotations

from zoo.search.traces import finish, moves
from zoo.tiny.tasks import Kind, Problem, Split, make_problems, tiny_problems

SEARCH_KNOBS: dict[str, object] = {"n_numbers": 3, "max_number": 9}
MAX_SOLVING = 2  # first moves that reach the target: 1-2 of about 9


def solving_moves(problem: Problem) -> int:
    return sum(finish(problem.target, m.rest) is not None for m in moves(problem.numbers))


def search_problems(
    kind: Kind, n: int, seed: int, split: Split = "any", max_solving: int = MAX_SOLVING
) -> list[Problem]:
    """``n`` problems of ``kind`` (same arguments, same list): Countdown filtered to at most
    ``max_solving`` solving first moves; arithmetic as the tiny model's (zoo.tiny.tiny_problems)."""
    if kind == "arith":
        return tiny_problems("arith", n, seed, split)
    draw = 2 * n + 20
    while True:  # about two in three problems are kept; the space holds about 8700 distinct ones
        pool = make_problems("countdown", draw, seed, split, **SEARCH_KNOBS)
        kept = [p for p in pool if solving_moves(p) <= max_solving]
        if len(kept) >= n:
            return kept[:n]
        draw = int(draw * 1.25) + 10


def training_problems(n: int, seed: int) -> dict[str, list[Problem]]:
    """``n`` training problems of each kind: what the search model's recipes draw first."""
    return {k: search_problems(k, n, seed=seed, split="train") for k in ("countdown", "arith")}  # type: ignore[misc]
