"""The tiny model's row of the recipe table (zoo/recipes.py; ``loom train-tiny``): seeded supervised
training from scratch on all formats.

Data mix: arithmetic and Countdown problems in the plain, reflect and stream formats, and Countdown in
the spawn format (parent and child traces). Observation pieces are masked out of the loss. The loop,
the tokenizer and the checkpoint are the one recipe's (zoo/recipe.py).
"""

from __future__ import annotations

from zoo.recipe import CardText, TrainConfig, reproduce
from zoo.tiny.evaluate import FormatResult, evaluate
from zoo.tiny.tasks import HELDOUT_SEED, Problem, tiny_problems
from zoo.tiny.traces import Piece, build_trace

# format -> kinds it is trained and evaluated on
MIX: dict[str, tuple[str, ...]] = {
    "plain": ("arith", "countdown"),
    "reflect": ("arith", "countdown"),
    "stream": ("arith", "countdown"),
    "spawn": ("countdown",),
}


def sequences(cfg: TrainConfig) -> list[list[Piece]]:
    """``train_problems`` problems per kind, each in every format of :data:`MIX`."""
    problems = {
        k: tiny_problems(k, cfg.train_problems, seed=cfg.seed, split="train")  # type: ignore[arg-type]
        for k in ("arith", "countdown")
    }
    seqs: list[list[Piece]] = []
    for fmt, kinds in MIX.items():
        for kind in kinds:
            for p in problems[kind]:
                seqs.extend(build_trace(p, fmt))
    return seqs


def eval_sets(n: int) -> dict[str, list[Problem]]:
    """Held-out problems per format (disjoint from training by the hash split)."""
    out: dict[str, list[Problem]] = {}
    for fmt, kinds in MIX.items():
        ps: list[Problem] = []
        for kind in kinds:
            ps += tiny_problems(kind, n, seed=HELDOUT_SEED, split="test")  # type: ignore[arg-type]
        out[fmt] = ps
    return out


def heldout(model, tok, n: int) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    return evaluate(model, tok, eval_sets(n))


def facts(cfg: TrainConfig, seqs: list[list[Piece]], data: object, model: object) -> dict:
    return {"mix": {fmt: list(kinds) for fmt, kinds in MIX.items()}}


# MODEL_CARD.md's paragraph, before the command that reproduces it
ABOUT = (
    "A small Llama trained from scratch by `loom train-tiny` on Loom's synthetic tasks\n"
    "(zoo/tiny/tasks.py) in every trace format (zoo/tiny/traces.py). Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [f"- data mix (format: kinds): {card['mix']}; {card['sequences']} training sequences"]
    threads = f"{card['torch_threads']} torch thread(s)"
    return CardText("Loom tiny model", ABOUT, reproduce("tiny", card, "seed", "steps"), data, threads)
