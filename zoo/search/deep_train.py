"""``loom train-deep``: the search model fine-tuned on four-number Countdown (zoo/search/deep.py), the
model APR's four-number problems need, shipped as the built-in model ``deep`` (zoo/search/deep_checkpoint;
docs/models.md, docs/benchmarks/apr.md).

It starts from the search checkpoint (``--init``; its tokenizer unchanged), keeps its 1024 positions
(:data:`MAX_POSITIONS`; ``max_len`` above it widens them, Llama's rotary positions need no new
weights) and trains one phase on, per four-number problem, the serial two-level search (cut at
``max_len``: a search longer than the window is what serial search cannot hold, APR's context
argument) and the spawn trace with one child per first move (the parent, every child that returned a
solution and ``child_keep`` of the others), mixed with the search model's three-number plain and spawn
traces so those skills are kept. Half the parents (``decoys``) see one decoy in their join block, a
wrong solution where a child found none, and are trained to answer from the first message that
reaches the target all the same: trained children sometimes return a slip (``72-1=71`` for 51).
``parent_variants`` more parents per problem see join blocks of their own (:func:`parent_variants`),
so that their answer can only be read from the join block, never recalled from the problem.
Held-out greedy accuracy is measured on four-number problems, plain and spawn (the children of a
spawn run one by one here; ``bench/apr.py --numbers 4`` runs them as spawn mode does).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loom.formats import DEFAULT_SPAWN
from zoo.recipe import CardText, FinetuneConfig, on_device, reproduce
from zoo.search.deep import DEEP_KNOBS, DEEP_MAX_SOLVING, answer_text, deep_moves, deep_problems
from zoo.search.deep import plain_trace as deep_plain
from zoo.search.deep import spawn_trace as deep_spawn
from zoo.search.tasks import search_problems
from zoo.search.traces import OPS, build_trace
from zoo.tiny.evaluate import Budgets, FormatResult, eval_plain, eval_spawn
from zoo.tiny.tasks import HELDOUT_SEED, Problem, _apply
from zoo.tiny.traces import Piece, SpawnTrace, join_block

# the search model's own window: every spawn thread fits (a parent's spawn block runs to about 800
# tokens for 22 first moves, a child's search to about 380), serial search is cut at it about half the
# time; ``--max-len 2048`` widens the positions (rotary: no new weights) at ~4x the cost per long batch
MAX_POSITIONS = 1024


# ``loom train-deep``'s own flags (zoo/recipes.py): config field -> help
FLAGS = {
    "train_problems": "four-number problems",
    "keep_problems": "three-number problems",
    "max_len": "positions (serial search cut at it)",
    "child_keep": "kept rate, no-solution children",
    "decoys": "rate of parents with a decoy message",
    "parent_variants": "more parents per problem",
}


def budgets(positions: int) -> Budgets:
    return Budgets(plain=positions - 40, spawn_head=min(960, positions - 64), child=420, join_answer=120)


@dataclass
class DeepTrainConfig(FinetuneConfig):
    steps: int = 7500  # the shipped checkpoint's (5979 s on the 2-core VM, 2 threads, alone)
    # batch 16 of up to 2048 tokens grew to 17.7 GB on CPU and was OOM-killed beside CI (2026-11-28)
    batch_size: int = 8
    train_problems: int = 2000  # four-number problems
    keep_problems: int = 500  # three-number problems, plain and spawn
    eval_problems: int = 40
    max_len: int = MAX_POSITIONS
    # children whose sub-search finds nothing, kept at this rate: at 1.0 children are 90 % of the
    # sequences and a parent's spawn block (the new skill) came up once in 22 draws
    child_keep: float = 0.25
    # parents whose join block carries one decoy (a child's slip: a solution that misses the target)
    decoys: float = 0.5
    # extra parents per problem whose join block differs from the trace's (:func:`parent_variants`)
    parent_variants: int = 3


def completions(problem: Problem, move_index: int, hit: bool) -> list[list[str]]:
    """Messages a child of first move ``move_index`` could return: the move and two steps on the three
    numbers it leaves (larger number first, as the three-number search writes them) that end on the
    target (``hit``) or off it (a slip)."""
    m = deep_moves(problem.numbers)[move_index]
    a, b, c = m.rest
    out = []
    for x, y, z in ((a, b, c), (a, c, b), (b, c, a)):
        for op1 in OPS:
            r1 = _apply(x, op1, y)
            if r1 is None:
                continue
            for op2 in OPS:
                u, v = max(r1, z), min(r1, z)
                r2 = _apply(u, op2, v)
                if r2 is not None and (r2 == problem.target) == hit:
                    out.append([m.step, f"{x}{op1}{y}={r1}", f"{u}{op2}{v}={r2}"])
    return out


def decoy(problem: Problem, messages: list[str], rng: random.Random) -> list[str] | None:
    """``messages`` with one ``No solution`` before the first solution replaced by a wrong one: the
    child's first move and two steps on what it leaves that end off the target, the slip a trained
    child makes (``72-1=71`` returned for 51); None where no such child or steps exist."""
    first = next(i for i, m in enumerate(messages) if m != DEFAULT_SPAWN.no_solution)
    for i in rng.sample(range(first), first):
        if options := completions(problem, i, hit=False):
            out = list(messages)
            out[i] = " ".join(rng.choice(options))
            return out
    return None


def parent_variants(problem: Problem, t: SpawnTrace, k: int, rng: random.Random) -> list[list[Piece]]:
    """``k`` more parents of ``t`` whose join block is not the trace's and whose answer therefore is
    not the serial trace's: each solving child returns a solution drawn from all its move's true ones,
    the first solving child (where another follows) returns ``No solution`` one time in three, and
    up to two decoys (:func:`decoy`) come before the first solution. Their prompt and spawn block are
    not trained again; only the answer is. The fifth four-number model's parent wrote answers of its
    own rather than the join block's (docs/benchmarks/apr.md): with one join block per problem the
    answer is learnt as much from the problem (whose serial trace ends in the same solution) as from
    the join block; here only the join block tells."""
    out: list[list[Piece]] = []
    prompt, head, _, _ = t.parent
    for _ in range(k):
        messages = list(t.messages)
        solving = [i for i, m in enumerate(messages) if m != DEFAULT_SPAWN.no_solution]
        for i in solving:
            messages[i] = " ".join(rng.choice(completions(problem, i, hit=True)))
        if len(solving) > 1 and rng.random() < 1 / 3:
            messages[solving[0]] = DEFAULT_SPAWN.no_solution
        for _ in range(rng.randint(0, 2)):
            messages = decoy(problem, messages, rng) or messages
        first = next(m for m in messages if m.endswith(f"={problem.target}"))
        out.append(
            [
                prompt,
                Piece(head.text, False),
                Piece(join_block(messages, DEFAULT_SPAWN), False),
                Piece(answer_text(first.split()), True),
            ]
        )
    return out


def build_sequences(
    deep: list[Problem],
    three: list[Problem],
    child_keep: float = 1.0,
    decoys: float = 0.0,
    variants: int = 0,
) -> list[list[Piece]]:
    """Per four-number problem its serial search, its spawn parent (with probability ``decoys`` one
    decoy in its join block, :func:`decoy`; the trained answer unchanged), every child that returned a
    solution and each other child with probability ``child_keep`` (seeded by the problem), and
    ``variants`` more parents with other join blocks (:func:`parent_variants`); three-number plain and
    spawn traces of ``three``."""
    seqs: list[list[Piece]] = []
    for p in deep:
        seqs.append(deep_plain(p))
        t = deep_spawn(p, by="move")
        rng = random.Random(f"{p.key}/keep")
        pairs = zip(t.children, t.messages, strict=True)
        kept = [c for c, m in pairs if m != DEFAULT_SPAWN.no_solution or rng.random() < child_keep]
        parent = list(t.parent)
        if rng.random() < decoys and (messages := decoy(p, t.messages, rng)) is not None:
            parent[2] = Piece(join_block(messages, DEFAULT_SPAWN), False)
        seqs.extend([parent, *kept, *parent_variants(p, t, variants, rng)])
    for p in three:
        seqs.extend(build_trace(p, "plain"))
        seqs.extend(build_trace(p, "spawn"))
    return seqs


def heldout(model, tok, n: int, b: Budgets | None = None) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    """Greedy held-out accuracy on four-number problems, serial (plain) and spawn."""
    problems = deep_problems(n, HELDOUT_SEED, "test")
    b = b or budgets(model.config.max_position_embeddings)
    return {"plain": eval_plain(model, tok, problems, b=b), "spawn": eval_spawn(model, tok, problems, b)}


def sequences(cfg: DeepTrainConfig) -> list[list[Piece]]:
    """The row's trace builder (zoo/recipes.py): :func:`build_sequences` of ``train_problems``
    four-number and ``keep_problems`` three-number training problems."""
    deep = deep_problems(cfg.train_problems, seed=cfg.seed, split="train")
    three = search_problems("countdown", cfg.keep_problems, seed=cfg.seed, split="train")
    return build_sequences(deep, three, cfg.child_keep, cfg.decoys, cfg.parent_variants)


def facts(
    cfg: DeepTrainConfig, seqs: list[list[Piece]], data: list[tuple[list[int], list[int]]], model
) -> dict:  # type: ignore[no-untyped-def]
    """The positions trained at, the problems, and how many sequences ``max_len`` cut."""
    return {
        "max_positions": model.config.max_position_embeddings,
        "problems": {"countdown": {**DEEP_KNOBS, "max_solving_first_moves": DEEP_MAX_SOLVING}},
        "sequences_cut_at_max_len": sum(len(ids) == cfg.max_len for ids, _ in data),
    }


# MODEL_CARD.md's paragraph, before the command that reproduces it
ABOUT = (
    "The search model fine-tuned by `loom train-deep` on four-number Countdown (zoo/search/deep.py):\n"
    "serial two-level search and spawn/join with one child per first move, mixed with three-number\n"
    "plain and spawn traces; {positions} positions. Reproduce with"
)


def card_text(card: dict) -> CardText:
    cfg = card["config"]
    about = ABOUT.format(positions=card["max_positions"])
    command = reproduce("deep", card, "seed", "steps", "lr")
    data = [
        f"- {card['sequences']} sequences, {card['sequences_cut_at_max_len']} cut at {cfg['max_len']} tokens;"
        f" problems {card['problems']}"
    ]
    return CardText("Loom deep-search model", about, command, data, on_device(card))
