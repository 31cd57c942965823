"""The search model's row of the recipe table (zoo/recipes.py; ``loom train-search``): from
a seed, on CPU or a GPU, in two phases of its own over the one recipe's loop (zoo/recipe.py).

Data (zoo/search/traces.py): Countdown search traces in the plain (two search orders per problem),
reflect (a long and a short re-check variant), stream and spawn (parent and its three children)
formats, and the tiny model's arithmetic in plain and stream. Observation pieces are masked out of the
loss; the loop, tokenizer training and checkpoint layout are the recipe's.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from zoo.recipe import (
    CardText,
    TrainConfig,
    card_markdown,
    device_name,
    encode,
    final_loss,
    finish,
    fit,
    reproduce,
)
from zoo.search.tasks import MAX_SOLVING, SEARCH_KNOBS, search_problems, training_problems
from zoo.search.traces import DRAWN, FIXED, Style, build_trace
from zoo.tiny.evaluate import Budgets, FormatResult, evaluate
from zoo.tiny.model import TinyConfig, build_model
from zoo.tiny.tasks import HELDOUT_SEED, Problem
from zoo.tiny.tokenizer import train_tokenizer
from zoo.tiny.traces import Piece, trace_text

# format -> (kind, search orders per problem)
MIX: dict[str, tuple[tuple[str, int], ...]] = {
    "plain": (("countdown", 2), ("arith", 1)),
    "reflect": (("countdown", 2),),
    "stream": (("countdown", 1), ("arith", 1)),
    "spawn": (("countdown", 1),),
}
MODEL = TinyConfig(hidden=192, layers=6, heads=6, intermediate=512, max_positions=1024)
# the traces are longer than the tiny model's: greedy limits of the held-out evaluation
BUDGETS = Budgets(plain=400, reflect=480, thought=24, final=400, spawn_head=160, child=200, join_answer=40)


@dataclass
class SearchTrainConfig(TrainConfig):
    """Two phases: ``steps`` on searches in drawn orders (zoo.search.traces.DRAWN), then
    ``fixed_steps`` at ``fixed_lr`` on searches in the fixed order with the target echoed before each
    verdict (FIXED), which the model then writes. Measured after phase 1 alone (2026-11-24): greedy
    held-out plain accuracy 0.05: the model repeated moves it had tried and missed a target among the
    four values, so phase 2 makes the next move and the comparison local. Phase 2 runs
    ``fixed_rounds`` times, each round a fresh AdamW with its own warm-up and cosine decay over the
    same batches (the same seed). Measured (2026-11-24, held-out greedy plain / reflect / stream /
    spawn): after one round 0.275 / 0.275 / 0.275 / 0.125, after two 0.500 / 0.450 / 0.475 / 0.425:
    the second round taught the verdict: after one round a child whose pair solves returned its
    solution in 6 of 57 cases (bench/apr.py's stages; the misses read ``no`` after the target among
    the values)."""

    steps: int = 1500
    lr: float = 2e-3
    warmup: int = 100
    fixed_steps: int = 400
    fixed_lr: float = 1e-3
    fixed_rounds: int = 2
    train_problems: int = 3000  # per kind
    eval_problems: int = 40  # per format
    max_len: int = 512


def build_sequences(problems: dict[str, list[Problem]], style: Style = FIXED) -> list[list[Piece]]:
    seqs: list[list[Piece]] = []
    for fmt, kinds in MIX.items():
        for kind, variants in kinds:
            for p in problems[kind]:
                if kind != "countdown":
                    seqs.extend(_arith(p, fmt))
                else:  # a fixed order writes one search per problem; reflect still varies its re-checks
                    n = variants if style.shuffle or fmt == "reflect" else 1
                    seqs.extend(build_trace(p, fmt, n, style))
    return seqs


def _arith(p: Problem, fmt: str) -> list[list[Piece]]:
    from zoo.search.traces import plain_trace, stream_trace

    return [plain_trace(p) if fmt == "plain" else stream_trace(p)]


def eval_sets(n: int) -> dict[str, list[Problem]]:
    """Held-out Countdown search problems per format (the tiny model is measured on the same sets)."""
    cd = search_problems("countdown", n, HELDOUT_SEED, "test")
    return {fmt: cd for fmt in MIX}


def heldout(model, tok, n: int, budgets: Budgets = BUDGETS) -> dict[str, FormatResult]:  # type: ignore[no-untyped-def]
    return evaluate(model, tok, eval_sets(n), budgets)


def sequences(cfg: SearchTrainConfig) -> list[list[Piece]]:
    """The row's trace builder: the fixed order the model writes (phase 2's data)."""
    return build_sequences(training_problems(cfg.train_problems, cfg.seed), FIXED)


def train(
    cfg: SearchTrainConfig,
    out_dir: Path | None,
    progress: bool = True,
    evaluate_after: bool = True,
    init: Path | None = None,
) -> dict:
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    problems = training_problems(cfg.train_problems, cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    phases: dict[str, dict] = {}
    if init is None:  # phase 1: drawn orders, from scratch
        seqs = build_sequences(problems, DRAWN)
        tok = train_tokenizer([trace_text(s) for s in seqs])
        model = build_model(tok, MODEL)
        model.to(device)  # type: ignore[arg-type]
        losses, secs = fit(model, tok, encode(seqs, tok, cfg.max_len), cfg, progress, "train-search 1/2")
        phases["drawn"] = _phase(cfg.steps, cfg.lr, secs, losses, len(seqs))
    else:  # earlier phases done before: ``--init DIR`` (its card.json records them)
        from zoo.tiny import load_model, load_tokenizer

        tok, model = load_tokenizer(init), load_model(init)
        model.to(device)  # type: ignore[arg-type]
        phases.update(_card_phases(init))
    seqs = build_sequences(problems, FIXED)
    data = encode(seqs, tok, cfg.max_len)
    fixed = SearchTrainConfig(**{**asdict(cfg), "steps": cfg.fixed_steps, "lr": cfg.fixed_lr, "warmup": 20})
    done = sum(k.startswith("fixed") for k in phases)
    for r in range(done + 1, done + cfg.fixed_rounds + 1):
        losses, secs = fit(model, tok, data, fixed, progress, f"train-search fixed round {r}")
        phases["fixed" if r == 1 else f"fixed_{r}"] = _phase(
            cfg.fixed_steps, cfg.fixed_lr, secs, losses, len(seqs)
        )
    train_s = sum(ph["train_seconds"] for ph in phases.values())
    model.to("cpu")  # type: ignore[arg-type]
    card: dict = {
        "config": asdict(cfg),
        "model": asdict(MODEL),
        "problems": {"countdown": {**SEARCH_KNOBS, "max_solving_first_moves": MAX_SOLVING}},
        "sequences": len(seqs),
        "phases": phases,
        "mix": {fmt: [list(k) for k in kinds] for fmt, kinds in MIX.items()},
        "device": device_name(device),
    }
    evaluate = (lambda: heldout(model, tok, cfg.eval_problems)) if evaluate_after else None
    return finish(
        card, model, tok, losses, train_s, evaluate, out_dir, lambda c: card_markdown(c, card_text(c))
    )


def _phase(steps: int, lr: float, secs: float, losses: list[float], sequences: int) -> dict:
    return {
        "steps": steps,
        "lr": lr,
        "sequences": sequences,
        "train_seconds": round(secs, 1),
        "torch_threads": torch.get_num_threads(),
        "final_loss": final_loss(losses),
        "loss_every_100": [round(x, 4) for x in losses[::100]],
    }


def _card_phases(init: Path) -> dict[str, dict]:
    """The phases ``init``'s card recorded (a card of phase 1 alone: that one phase)."""
    old = json.loads((init / "card.json").read_text())
    if "phases" in old:
        return {k: dict(v) for k, v in old["phases"].items()}
    keys = ("train_seconds", "torch_threads", "final_loss", "loss_every_100", "sequences", "heldout")
    return {
        "drawn": {
            "steps": old["config"]["steps"],
            "lr": old["config"]["lr"],
            **{k: old[k] for k in keys if k in old},
        }
    }


def facts(cfg: SearchTrainConfig, seqs: list[list[Piece]], data: object, model: object) -> dict:
    return {}  # its own train records its phases


# MODEL_CARD.md's paragraph, before the command that reproduces it
ABOUT = (
    "A small Llama trained from scratch by `loom train-search` on Countdown search traces\n"
    "(zoo/search/traces.py: the search written out move by move, with backtracking) in the plain,\n"
    "reflect, stream and spawn formats, and on the tiny model's arithmetic. Reproduce with"
)


def card_text(card: dict) -> CardText:
    data = [
        f"- problems: {card['problems']}",
        f"- data mix (format: kind, search orders): {card['mix']}; {card['sequences']} sequences",
        "- phases (drawn orders, then rounds of the fixed order it writes): "
        + "; ".join(
            f"{k}: {v['steps']} steps, lr {v['lr']}, {v['train_seconds']} s on {v['torch_threads']} thread(s)"
            for k, v in card["phases"].items()
        ),
    ]
    heldout = "Held-out greedy accuracy (Countdown search problems)"
    return CardText(
        "Loom search model",
        ABOUT,
        reproduce("search", card, "seed", "steps", "fixed_steps", "fixed_rounds"),
        data,
        card["device"],
        heldout,
    )
