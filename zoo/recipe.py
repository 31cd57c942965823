"""The one recipe of Loom's built-in models (docs/models.md): data -> fit -> finish -> checkpoint.

Each model is a :class:`Recipe`, a row of the table in ``zoo.recipes``: its name, the model it starts
from (``base``; none: a tokenizer and a model trained from scratch), its defaults (a
:class:`TrainConfig`), its trace builder, its held-out evaluation and what its card says. One
:func:`train` runs every row the same way, and one :func:`main` is every ``loom train-<name>``: the
shared flags, the row's own, ``--init`` where the row has a base. The search model's two phases are
its own ``train`` (zoo/search/train.py) over the same :func:`fit` and :func:`write_checkpoint`.

The order of the seeded draws is the recipes' own (problems, traces, tokenizer, then the model's
initialisation), so the same command with the same flags writes the same weights on the same
machine: the shipped checkpoints' cards state their command.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tqdm import tqdm

from loom.runtime import configure_process
from zoo.registry import resolve_model_path
from zoo.tiny.model import TinyConfig, build_model, model_shape, n_params
from zoo.tiny.tokenizer import train_tokenizer
from zoo.tiny.traces import Piece, trace_text

if TYPE_CHECKING:
    from zoo.tiny.evaluate import FormatResult


@dataclass
class TrainConfig:
    """The fields every recipe has; a row's config subclasses it with its own defaults."""

    seed: int = 0
    steps: int = 1200
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    train_problems: int = 3000  # per kind
    eval_problems: int = 40  # per format and kind
    max_len: int = 256


@dataclass
class FinetuneConfig(TrainConfig):
    """One phase from a built-in checkpoint (a fresh AdamW, warm-up and cosine decay)."""

    steps: int = 300
    lr: float = 5e-4
    warmup: int = 20
    max_len: int = 512


@dataclass(frozen=True)
class CardText:
    """What a checkpoint's MODEL_CARD.md says beside the numbers (:func:`card_markdown`)."""

    title: str
    about: str  # what it learned (its lines as they stand in the card), ending in "Reproduce with"
    command: str  # the command that reproduces it (:func:`reproduce`)
    data: list[str]  # its data lines
    trained_on: str  # the threads or the device
    heldout: str = "Held-out greedy accuracy"


class RowModule(Protocol):
    """What a row's module provides (zoo/tiny/train.py, zoo/search/stream.py, ...)."""

    def sequences(self, cfg: Any) -> list[list[Piece]]: ...  # the trace builder

    def heldout(self, model: Any, tok: Any, n: int) -> dict[str, FormatResult]: ...  # n per format

    def card_text(self, card: dict) -> CardText: ...  # what its MODEL_CARD.md says

    # what its card.json records of (config, sequences, encoded data, model), beside the run's facts
    def facts(
        self, cfg: Any, seqs: list[list[Piece]], data: list[tuple[list[int], list[int]]], model: Any
    ) -> dict: ...


@dataclass(frozen=True)
class Recipe:
    """One built-in model's row: how ``loom train-<name>`` makes ``zoo.registry``'s checkpoint."""

    name: str
    module: RowModule  # its trace builder, held-out evaluation and card
    config: type[TrainConfig]  # the defaults
    description: str  # the command's one line
    base: str | None = None  # the built-in model it starts from (``--init``'s default); None: scratch
    model: TinyConfig = TinyConfig()  # the architecture of a model trained from scratch
    flags: dict[str, str] = field(default_factory=dict)  # its own flags: config field -> help
    gpu: bool = True  # trains on a GPU when torch sees one (tiny: the CPU, as its shipped checkpoint)
    init_help: str | None = None  # ``--init`` without a base (the search model's later phases)
    train: Callable[..., dict] | None = None  # a recipe of its own in place of :func:`train`


def train(
    recipe: Recipe,
    cfg: TrainConfig,
    out_dir: Path | None,
    init: Path | None = None,
    progress: bool = True,
    evaluate_after: bool = True,
) -> dict:
    """Seed, build the row's sequences, start the model (``init``, else the row's base, else a tokenizer
    and a model trained from scratch), fit, and :func:`finish`; returns the card (with ``losses``).
    A row with a recipe of its own (``Recipe.train``) runs that."""
    if recipe.train is not None:
        return recipe.train(cfg, out_dir, init=init, progress=progress, evaluate_after=evaluate_after)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    seqs = recipe.module.sequences(cfg)
    base = resolve_model_path(recipe.base) if recipe.base else None
    init = init if init is not None else base
    if init is None:
        tok = train_tokenizer([trace_text(s) for s in seqs])
        model = build_model(tok, recipe.model)
    else:
        from zoo.tiny import load_model, load_tokenizer

        tok, model = load_tokenizer(init), load_model(init)
        # a window wider than the checkpoint's widens its positions (rotary: no new weights)
        model.config.max_position_embeddings = max(model.config.max_position_embeddings, cfg.max_len)
        tok.model_max_length = model.config.max_position_embeddings
    device = "cuda" if recipe.gpu and torch.cuda.is_available() else "cpu"
    model.to(device)  # type: ignore[arg-type]
    data = encode(seqs, tok, cfg.max_len)
    losses, secs = fit(model, tok, data, cfg, progress, f"train-{recipe.name}")
    model.to("cpu")  # type: ignore[arg-type]
    card: dict = {"config": asdict(cfg)}
    if init is not None:
        card["init"] = recipe.base if base is not None and _same(init, base) else str(init)
    card.update(
        model=asdict(model_shape(model)),
        sequences=len(seqs),
        **recipe.module.facts(cfg, seqs, data, model),
        device=device_name(device),
    )
    evaluate = (lambda: recipe.module.heldout(model, tok, cfg.eval_problems)) if evaluate_after else None
    return finish(
        card,
        model,
        tok,
        losses,
        secs,
        evaluate,
        out_dir,
        lambda c: card_markdown(c, recipe.module.card_text(c)),
    )


def _same(a: Path, b: Path) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def encode(seqs: list[list[Piece]], tok, max_len: int) -> list[tuple[list[int], list[int]]]:  # type: ignore[no-untyped-def]
    """Token ids and labels (-100 on observations) piece by piece, eos appended and trained."""
    texts = [piece.text for pieces in seqs for piece in pieces]
    encoded = iter(tok(texts, add_special_tokens=False)["input_ids"])  # one batched call
    out = []
    for pieces in seqs:
        ids: list[int] = []
        labels: list[int] = []
        for piece in pieces:
            t = next(encoded)
            ids += t
            labels += t if piece.train else [-100] * len(t)
        ids.append(tok.eos_token_id)
        labels.append(tok.eos_token_id)
        out.append((ids[:max_len], labels[:max_len]))
    return out


def fit(model, tok, data: list[tuple[list[int], list[int]]], cfg: TrainConfig, progress: bool, desc: str):  # type: ignore[no-untyped-def]
    """AdamW with warm-up and cosine decay on ``data`` (ids, labels), batches of similar lengths;
    returns (per-step losses, seconds)."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + torch.cos(torch.tensor(frac * torch.pi)).item()))

    # SDPA trains 3.4x faster than eager at 1024 tokens, 3.3x at 2048 (2-core VM, docs/models.md); the
    # model goes back to its own attention after (eager from load_model: the engines read its weights)
    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    rng = random.Random(cfg.seed)
    losses: list[float] = []
    device = next(model.parameters()).device  # a GPU when the caller put the model there
    t0 = time.perf_counter()
    model.train()
    bar = tqdm(range(cfg.steps), desc=desc, disable=not progress)
    queue: list[list[tuple[list[int], list[int]]]] = []
    for step in bar:
        if not queue:  # draw 4 batches at once and group them by length: less padding, same mix
            pool = sorted(
                (data[rng.randrange(len(data))] for _ in range(4 * cfg.batch_size)), key=lambda d: len(d[0])
            )
            queue = [pool[k : k + cfg.batch_size] for k in range(0, len(pool), cfg.batch_size)]
            rng.shuffle(queue)
        batch = queue.pop()
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = model(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)
        ).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    model.set_attn_implementation(attention)
    return losses, time.perf_counter() - t0


def run_facts(model, tok, losses: list[float], seconds: float) -> dict:  # type: ignore[no-untyped-def]
    """What every built-in model's card records of its training run."""
    return {
        "params": n_params(model),
        "vocab_size": len(tok),
        "train_seconds": round(seconds, 1),
        "final_loss": final_loss(losses),
        "torch_threads": torch.get_num_threads(),
    }


def device_name(device: str) -> str:
    """A card's ``device``: ``cpu``, or the GPU's name."""
    return device if device == "cpu" else torch.cuda.get_device_name()


def final_loss(losses: list[float]) -> float:
    """The mean of the last 50 steps' losses, as a card records it."""
    return round(sum(losses[-50:]) / len(losses[-50:]), 4)


def heldout_row(r: FormatResult) -> dict:
    """A format's held-out result as a card records it."""
    return {"accuracy": round(r.accuracy, 4), "parsed": r.parsed, "correct": r.correct, "total": r.total}


def record_heldout(card: dict, evaluate: Callable[[], dict[str, FormatResult]]) -> None:
    """Run the held-out evaluation and record it on ``card``: its seconds, a row and a sample per format."""
    t1 = time.perf_counter()
    results = evaluate()
    card["eval_seconds"] = round(time.perf_counter() - t1, 1)
    card["heldout"] = {fmt: heldout_row(r) for fmt, r in results.items()}
    card["samples"] = {fmt: r.sample for fmt, r in results.items()}


def finish(  # type: ignore[no-untyped-def]
    card: dict,
    model,
    tok,
    losses: list[float],
    seconds: float,
    heldout: Callable[[], dict[str, FormatResult]] | None,
    out_dir: Path | None,
    card_md: Callable[[dict], str],
) -> dict:
    """The end every recipe shares: the run's facts and its loss every 50 steps on ``card``, the
    held-out evaluation when ``heldout`` is given, the checkpoint with ``card_md(card)`` when
    ``out_dir`` is; the card returned keeps every step's loss (``losses``), card.json does not."""
    card.update(run_facts(model, tok, losses, seconds))
    card["loss_every_50"] = [round(x, 4) for x in losses[::50]]
    if heldout is not None:
        record_heldout(card, heldout)
    if out_dir is not None:
        write_checkpoint(model, tok, out_dir, card, card_md(card))
    card["losses"] = losses
    return card


def card_markdown(card: dict, text: CardText) -> str:
    """A checkpoint's MODEL_CARD.md: the title, the about paragraph, the model's size, the data lines,
    the training run, and the table of held-out accuracy, a row per format."""
    cfg = card["config"]
    lines = [
        f"# {text.title}",
        "",
        *text.about.splitlines(),
        text.command,
        "",
        f"- parameters: {card['params']:,}; vocabulary: {card['vocab_size']} (byte-level BPE, single digits)",
        f"- architecture: {card['model']}",
        *text.data,
        f"- steps {cfg['steps']}, batch {cfg['batch_size']}, lr {cfg['lr']}, seed {cfg['seed']}",
        f"- training time: {card['train_seconds']} s on {text.trained_on}; final loss {card['final_loss']}",
        "",
        f"## {text.heldout}",
        "",
        "| format | accuracy | parsed | total |",
        "|---|---|---|---|",
    ]
    for fmt, r in card.get("heldout", {}).items():
        lines.append(f"| {fmt} | {r['accuracy']:.3f} | {r['parsed']} | {r['total']} |")
    return "\n".join(lines) + "\n"


def reproduce(name: str, card: dict, *flags: str) -> str:
    """A card's command line: ``loom train-<name>`` with ``flags`` at the values its config records."""
    given = (f"--{f.replace('_', '-')} {card['config'][f]}" for f in flags)
    return "`" + " ".join([f"loom train-{name}", *given]) + "`."


def on_device(card: dict) -> str:
    """The training run's line of a card trained where a GPU may be: the device and the threads."""
    return f"{card['device']}, {card['torch_threads']} torch thread(s)"


def print_card(card: dict) -> None:
    """What every ``loom train-<name>`` prints when done."""
    print(f"params {card['params']:,}  train {card['train_seconds']} s  final loss {card['final_loss']}")
    for fmt, r in card.get("heldout", {}).items():
        print(
            f"held-out {fmt:8s} accuracy {r['accuracy']:.3f}"
            f" ({r['correct']}/{r['total']}, parsed {r['parsed']})"
        )


def write_checkpoint(model, tok, out_dir: Path, card_json: dict, card_md: str) -> None:  # type: ignore[no-untyped-def]
    """Weights (safetensors), the tokenizer, card.json (without every step's ``losses`` and the
    held-out ``samples``, which only the returned card holds) and MODEL_CARD.md in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    slim = {k: v for k, v in card_json.items() if k not in ("samples", "losses")}
    (out_dir / "card.json").write_text(json.dumps(slim, indent=2) + "\n")
    (out_dir / "MODEL_CARD.md").write_text(card_md)


def parser(recipe: Recipe) -> argparse.ArgumentParser:
    """``loom train-<name>``'s flags: the shared ones and the row's own, with the row's defaults."""
    d = recipe.config()
    p = argparse.ArgumentParser(prog=f"loom train-{recipe.name}", description=recipe.description)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--eval-problems", type=int, default=d.eval_problems)
    for name, help in recipe.flags.items():
        default = getattr(d, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default, help=help)
    if recipe.base is not None:
        p.add_argument("--init", type=Path, default=None, help=f"default: the {recipe.base} model")
    elif recipe.init_help is not None:
        p.add_argument("--init", type=Path, default=None, help=recipe.init_help)
    p.add_argument("--out", type=Path, default=None, help="default: the package checkpoint directory")
    p.add_argument("--no-eval", action="store_true")
    return p


SHARED = ("seed", "steps", "batch_size", "lr", "eval_problems")


def main(recipe: Recipe, argv: Sequence[str] | None = None) -> int:
    """``loom train-<name>``: parse the flags, train the row, write its checkpoint, print its card."""
    args = parser(recipe).parse_args(argv)
    configure_process()
    cfg = recipe.config(**{name: getattr(args, name) for name in (*SHARED, *recipe.flags)})
    out = args.out or resolve_model_path(recipe.name)
    print_card(train(recipe, cfg, out, init=getattr(args, "init", None), evaluate_after=not args.no_eval))
    return 0
