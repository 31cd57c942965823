"""Loom's fourth built-in model, ``reflect``: the search model fine-tuned on reflect traces
whose answer first appears mid-reasoning, after reflections that do work, so that REA-RL's
truncation has overthinking to remove and its reflection reward has reflections worth keeping.

The search model's reflect traces (zoo/search/traces.py) state the answer right after the search
and only then re-check it, so every reflection is redundant: a gold-truncated revision keeps none and
the length reward shortens only by dropping them (docs/benchmarks/rea-seeds.md). Real reasoning
models reflect inside the reasoning too ("But ...", "Wait, ..."), and some of those reflections
catch a mistake. Here a trace is the search model's search (FIXED order) written with:

- a backtracking word (``But`` or ``Alternatively``, REA-RL eq. 3's keywords) opening a line after a
  failed move, with probability :data:`BACKTRACK_WORD` per line;
- optionally (``--mistake P``, default 0: off in the shipped model), with probability P when the
  search has a failed move, one failed move wrongly claimed as a finish (``... 22? yes 5+4=22``, the
  values on the line say otherwise), the wrong answer stated, then a blank line and a check that
  catches it (``Wait, let me check: 7-3=4 5+4=9. No.``) before the search goes on. Trained at P = 0.3
  this variant lost held-out accuracy: the model learned to claim wrong finishes and its checks
  rejected right ones (docs/models.md);
- after the right answer (``So the answer is (5*3)+7.``), 0 to 3 redundant re-checks, the search
  model's pool: the overthinking REA-RL's truncation cuts.

The paragraphs are separated by blank lines, so reflect_svc's chunks (REA-RL appendix A) end at the
stated answers and the gold detector cuts after the chunk with the right one, keeping the search's
reflections (and a caught mistake), removing the re-checks.

``loom train-reflect`` starts from the search checkpoint (``--init``) and trains one phase on these
traces mixed with the search model's plain Countdown search and the tiny model's arithmetic (plain
and reflect), so the other skills are kept. docs/models.md describes it; docs/benchmarks/rea-reflect.md
measures it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loom.formats import FORCED_ENDING
from zoo.recipe import CardText, FinetuneConfig, on_device, reproduce
from zoo.search.tasks import search_problems, training_problems
from zoo.search.traces import FIXED, Move, expression_from_steps, moves, rechecks, search, search_line
from zoo.search.traces import plain_trace as search_plain_trace
from zoo.tiny.evaluate import Budgets, FormatResult, eval_plain
from zoo.tiny.tasks import HELDOUT_SEED, Problem, _apply
from zoo.tiny.traces import Piece, _state, boxed, reflect_prompt
from zoo.tiny.traces import plain_trace as arith_plain_trace
from zoo.tiny.traces import reflect_trace as arith_reflect_trace

BACKTRACK_WORDS = ("But", "Alternatively")
BACKTRACK_WORD = 0.8  # P(a line after a failed move opens with a backtracking word)


def wrong_finish(target: int, m: Move, rng: random.Random) -> tuple[str, str]:
    """A failed move's mistaken claim: (``a op b=target``, the check's ``a op b=value``)."""
    a, b = m.rest
    ops = [op for op in "+-*" if _apply(a, op, b) not in (None, target)]
    op = rng.choice(ops)
    return f"{a}{op}{b}={target}", f"{a}{op}{b}={_apply(a, op, b)}"


def reflect_think(
    problem: Problem, rng: random.Random, checks: tuple[int, int], mistake: float = 0.0
) -> tuple[str, str]:
    """The thinking text (without ``<think>``) and the right answer's expression; ``mistake``: P(one
    failed move claimed as a finish, then caught), given a failed move."""
    order = moves(problem.numbers)
    lines, solution = search(problem.target, order, FIXED)
    if solution is None:
        raise ValueError(f"{problem.text}: no solution (not a generated problem?)")
    answer = expression_from_steps(solution)
    wrong_at = rng.randrange(len(lines) - 1) if len(lines) > 1 and rng.random() < mistake else None
    paragraphs: list[str] = []
    cur = [_state(problem.target, problem.numbers)]
    for i, line in enumerate(lines):
        word = f"{rng.choice(BACKTRACK_WORDS)} " if i > 0 and rng.random() < BACKTRACK_WORD else ""
        if i == wrong_at:
            m = order[i]
            claim, actual = wrong_finish(problem.target, m, rng)
            cur.append(word + search_line(problem.target, m, FIXED).removesuffix(" no") + f" yes {claim}")
            cur.append(f"So the answer is {expression_from_steps([m.step, claim])}.")
            paragraphs.append("\n".join(cur))
            cur = [f"Wait, let me check: {m.step} {actual}. No."]
            continue
        cur.append(word + line)
    cur.append(f"So the answer is {answer}.")
    paragraphs.append("\n".join(cur))
    pool = rechecks(problem, answer, solution)
    rng.shuffle(pool)
    paragraphs.extend(pool[i % len(pool)] for i in range(rng.randint(*checks)))
    return "\n\n".join(paragraphs), answer


def reflect_trace(
    problem: Problem, variant: int = 0, checks: tuple[int, int] = (1, 3), mistake: float = 0.0
) -> list[Piece]:
    """A reflect trace (Countdown) as the module describes; arithmetic keeps the tiny model's."""
    rng = random.Random(f"{problem.key}/reflect/{variant}")
    if problem.kind == "arith":
        return arith_reflect_trace(problem, rng, checks)
    think, answer = reflect_think(problem, rng, checks, mistake)
    return [
        Piece(reflect_prompt(problem), False),
        Piece(f"<think> {think}{FORCED_ENDING}{boxed(answer)}", True),
    ]


# ------------------------------------------------------------------------------------------- training

BUDGETS = Budgets(plain=400, reflect=480, thought=24, final=400, spawn_head=160, child=200, join_answer=40)


@dataclass
class ReflectTrainConfig(FinetuneConfig):
    reflect_variants: int = 2  # reflect traces per Countdown problem: 1-3 re-checks, then 0-1
    mistake: float = 0.0  # P(a caught mistake) per trace with a failed move (reflect_think)


def build_sequences(
    problems: dict[str, list[Problem]], variants: int, mistake: float = 0.0
) -> list[list[Piece]]:
    """Reflect traces of Countdown (``variants`` per problem, alternating 1-3 and 0-1 re-checks) and
    arithmetic, and plain Countdown search and arithmetic (kept from the search model's mix)."""
    seqs: list[list[Piece]] = []
    for p in problems["countdown"]:
        seqs.extend(reflect_trace(p, v, (1, 3) if v % 2 == 0 else (0, 1), mistake) for v in range(variants))
        seqs.append(search_plain_trace(p, 0, FIXED))
    for p in problems["arith"]:
        seqs.append(reflect_trace(p, 0))
        seqs.append(arith_plain_trace(p))
    return seqs


def sequences(cfg: ReflectTrainConfig) -> list[list[Piece]]:
    """The row's trace builder (zoo/recipes.py): :func:`build_sequences` of the training problems."""
    return build_sequences(training_problems(cfg.train_problems, cfg.seed), cfg.reflect_variants, cfg.mistake)


def facts(cfg: ReflectTrainConfig, seqs: list[list[Piece]], data: object, model: object) -> dict:
    return {"backtrack_word": BACKTRACK_WORD, "mistake": cfg.mistake}


def heldout(model, tok, n: int) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    """Greedy held-out accuracy in the formats it was trained on (the search model's held-out set)."""
    cd = search_problems("countdown", n, HELDOUT_SEED, "test")
    return {
        "plain": eval_plain(model, tok, cd, b=BUDGETS),
        "reflect": eval_plain(model, tok, cd, reflect=True, b=BUDGETS),
    }


# MODEL_CARD.md's paragraph, before the command that reproduces it
ABOUT = (
    "The search model (zoo/search/checkpoint) fine-tuned by `loom train-reflect` on reflect\n"
    "traces whose answer first appears mid-reasoning: backtracking words in the search, then\n"
    "redundant re-checks (zoo/search/reflect.py), mixed with plain Countdown search and\n"
    "arithmetic. Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [
        f"- {card['sequences']} sequences; P(backtracking word) {card['backtrack_word']},"
        f" P(caught mistake) {card['mistake']}"
    ]
    return CardText(
        "Loom reflect model",
        ABOUT,
        reproduce("reflect", card, "seed", "steps", "lr", "mistake"),
        data,
        on_device(card),
    )
