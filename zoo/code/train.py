"""The code model's row of the recipe table (zoo/recipes.py; ``loom train-code``): seeded supervised
training from scratch on the code traces (zoo/code/traces.py) of generated problems
(zoo/code/tasks.py), one trace per training problem. The held-out evaluation runs the greedy
programs in the sandbox service (zoo/code/evaluate.py), so ``loom train-code`` needs one running
(``loom api sandbox``) unless ``--no-eval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zoo.code.evaluate import evaluate
from zoo.code.tasks import HELDOUT_SEED, SOURCES, code_problems
from zoo.code.traces import code_trace
from zoo.recipe import CardText, TrainConfig, reproduce
from zoo.tiny.evaluate import FormatResult
from zoo.tiny.model import TinyConfig
from zoo.tiny.traces import Piece


@dataclass
class CodeTrainConfig(TrainConfig):
    """Short on purpose: the shipped model solves part of the held-out problems, not all, so an RL
    run has reward to gain (docs/models.md "The code model"; 500 steps solved 92 of 100)."""

    steps: int = 250
    train_problems: int = 3000  # in all
    eval_problems: int = 100  # in all
    max_len: int = 128


MODEL = TinyConfig(hidden=128, layers=4, heads=4, intermediate=384, max_positions=256)


def sequences(cfg: TrainConfig) -> list[list[Piece]]:
    return [code_trace(p) for p in code_problems(cfg.train_problems, seed=cfg.seed, split="train")]


def heldout(model, tok, n: int) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    return evaluate(model, tok, code_problems(n, seed=HELDOUT_SEED, split="test"))


def facts(
    cfg: TrainConfig, seqs: list[list[Piece]], data: list[tuple[list[int], list[int]]], model: object
) -> dict:
    return {
        "sources": list(SOURCES),
        "completion_tokens_max": max(sum(t != -100 for t in lab) for _, lab in data),
    }


ABOUT = (
    "A small Llama trained from scratch by `loom train-code` on Loom's generated programming problems\n"
    "(zoo/code/tasks.py): the statement in, a fenced Python block with the function out\n"
    "(zoo/code/traces.py). Held-out programs are run against their tests in the sandbox. Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [f"- problems (sources: {', '.join(card['sources'])}); {card['sequences']} training sequences"]
    return CardText(
        "Loom code model",
        ABOUT,
        reproduce("code", card, "seed", "steps"),
        data,
        f"{card['torch_threads']} torch thread(s)",
        heldout="Held-out greedy code reward (tests run in the sandbox)",
    )
