"""``loom train-deep``: the search model fine-tuned on four-number Countdown (zoo/search/deep.py), the
model issue 38's APR item needs, shipped as the built-in model ``deep`` (zoo/search/deep_checkpoint;
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from loom.formats import DEFAULT_SPAWN
from loom.runtime import configure_process
from zoo.search import DEEP_CHECKPOINT_DIR
from zoo.search.deep import DEEP_KNOBS, DEEP_MAX_SOLVING, answer_text, deep_moves, deep_problems
from zoo.search.deep import plain_trace as deep_plain
from zoo.search.deep import spawn_trace as deep_spawn
from zoo.search.tasks import search_problems
from zoo.search.traces import OPS, build_trace
from zoo.search.train import MODEL
from zoo.tiny.evaluate import Budgets, FormatResult, eval_plain, eval_spawn
from zoo.tiny.tasks import HELDOUT_SEED, Problem, _apply
from zoo.tiny.traces import Piece, SpawnTrace, join_block
from zoo.tiny.train import TrainConfig

# the search model's own window: every spawn thread fits (a parent's spawn block runs to about 800
# tokens for 22 first moves, a child's search to about 380), serial search is cut at it about half the
# time; ``--max-len 2048`` widens the positions (rotary: no new weights) at ~4x the cost per long batch
MAX_POSITIONS = 1024


def budgets(positions: int) -> Budgets:
    return Budgets(plain=positions - 40, spawn_head=min(960, positions - 64), child=420, join_answer=120)


@dataclass
class DeepTrainConfig(TrainConfig):
    steps: int = 7500  # the shipped checkpoint's (5979 s on the 2-core VM, 2 threads, alone)
    # batch 16 of up to 2048 tokens grew to 17.7 GB on CPU and was OOM-killed beside CI (2026-11-28)
    batch_size: int = 8
    lr: float = 5e-4
    warmup: int = 20
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


def train(cfg: DeepTrainConfig, init: Path, out_dir: Path | None, evaluate_after: bool = True) -> dict:
    from zoo.tiny import load_model, load_tokenizer
    from zoo.tiny.train import device_name, encode, finish_finetune, fit

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    deep = deep_problems(cfg.train_problems, seed=cfg.seed, split="train")
    three = search_problems("countdown", cfg.keep_problems, seed=cfg.seed, split="train")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok, model = load_tokenizer(init), load_model(init)
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, cfg.max_len)
    tok.model_max_length = model.config.max_position_embeddings
    model.to(device)  # type: ignore[arg-type]
    seqs = build_sequences(deep, three, cfg.child_keep, cfg.decoys, cfg.parent_variants)
    data = encode(seqs, tok, cfg.max_len)
    cut = sum(len(ids) == cfg.max_len for ids, _ in data)
    losses, secs = fit(model, tok, data, cfg, True, "train-deep")
    model.to("cpu")  # type: ignore[arg-type]
    card: dict = {
        "config": asdict(cfg),
        "init": str(init),
        "model": asdict(replace(MODEL, max_positions=model.config.max_position_embeddings)),
        "max_positions": model.config.max_position_embeddings,
        "problems": {"countdown": {**DEEP_KNOBS, "max_solving_first_moves": DEEP_MAX_SOLVING}},
        "sequences": len(seqs),
        "sequences_cut_at_max_len": cut,
        "device": device_name(device),
    }
    evaluate = (lambda: heldout(model, tok, cfg.eval_problems)) if evaluate_after else None
    return finish_finetune(card, model, tok, losses, secs, evaluate, out_dir, model_card)


def model_card(card: dict) -> str:
    from zoo.tiny.train import card_markdown

    cfg = card["config"]
    about = [
        "The search model fine-tuned by `loom train-deep` on four-number Countdown (zoo/search/deep.py):",
        "serial two-level search and spawn/join with one child per first move, mixed with three-number",
        f"plain and spawn traces; {card['max_positions']} positions. Reproduce with",
        f"`loom train-deep --seed {cfg['seed']} --steps {cfg['steps']} --lr {cfg['lr']}`.",
    ]
    data = [
        f"- {card['sequences']} sequences, {card['sequences_cut_at_max_len']} cut at {cfg['max_len']} tokens;"
        f" problems {card['problems']}"
    ]
    trained_on = f"{card['device']}, {card['torch_threads']} torch thread(s)"
    return card_markdown(card, "Loom deep-search model", about, data, trained_on, "Held-out greedy accuracy")


def main(argv: Sequence[str] | None = None) -> int:
    from zoo.search import SEARCH_CHECKPOINT_DIR
    from zoo.tiny.train import print_card, shared_config, training_parser

    d = DeepTrainConfig()
    p = training_parser("loom train-deep", "train the four-number search model (the built-in `deep`)", d)
    p.add_argument("--train-problems", type=int, default=d.train_problems, help="four-number problems")
    p.add_argument("--keep-problems", type=int, default=d.keep_problems, help="three-number problems")
    p.add_argument("--max-len", type=int, default=d.max_len, help="positions (serial search cut at it)")
    p.add_argument("--child-keep", type=float, default=d.child_keep, help="kept rate, no-solution children")
    p.add_argument("--decoys", type=float, default=d.decoys, help="rate of parents with a decoy message")
    p.add_argument("--parent-variants", type=int, default=d.parent_variants, help="more parents per problem")
    p.add_argument("--init", type=Path, default=SEARCH_CHECKPOINT_DIR, help="default: the search model")
    args = p.parse_args(argv)
    configure_process()
    cfg = DeepTrainConfig(
        **shared_config(args),
        train_problems=args.train_problems,
        keep_problems=args.keep_problems,
        child_keep=args.child_keep,
        decoys=args.decoys,
        parent_variants=args.parent_variants,
        max_len=args.max_len,
    )
    card = train(cfg, args.init, args.out or DEEP_CHECKPOINT_DIR, evaluate_after=not args.no_eval)
    print_card(card)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
