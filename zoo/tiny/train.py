"""``loom train-tiny``: reproduce the built-in tiny model (seeded supervised training on all formats).

Data mix: arithmetic and Countdown problems in the plain, reflect and stream formats, and Countdown in
the spawn format (parent and child traces). Observation pieces are masked out of the loss. Writes
safetensors weights, the tokenizer, MODEL_CARD.md and card.json with held-out greedy accuracy.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from loom.runtime import configure_process
from zoo.tiny.model import TinyConfig, build_model, n_params
from zoo.tiny.tasks import HELDOUT_SEED, Problem, tiny_problems
from zoo.tiny.tokenizer import train_tokenizer
from zoo.tiny.traces import Piece, build_trace, trace_text

if TYPE_CHECKING:
    from zoo.tiny.evaluate import FormatResult

# format -> kinds it is trained and evaluated on
MIX: dict[str, tuple[str, ...]] = {
    "plain": ("arith", "countdown"),
    "reflect": ("arith", "countdown"),
    "stream": ("arith", "countdown"),
    "spawn": ("countdown",),
}


@dataclass
class TrainConfig:
    seed: int = 0
    steps: int = 1200
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 50
    weight_decay: float = 0.01
    train_problems: int = 3000  # per kind
    eval_problems: int = 40  # per format and kind
    max_len: int = 256


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


def build_sequences(problems: dict[str, list[Problem]]) -> list[list[Piece]]:
    seqs: list[list[Piece]] = []
    for fmt, kinds in MIX.items():
        for kind in kinds:
            for p in problems[kind]:
                seqs.extend(build_trace(p, fmt))
    return seqs


def eval_sets(cfg: TrainConfig) -> dict[str, list[Problem]]:
    """Held-out problems per format (disjoint from training by the hash split)."""
    out: dict[str, list[Problem]] = {}
    for fmt, kinds in MIX.items():
        ps: list[Problem] = []
        for kind in kinds:
            ps += tiny_problems(kind, cfg.eval_problems, seed=HELDOUT_SEED, split="test")  # type: ignore[arg-type]
        out[fmt] = ps
    return out


def train(cfg: TrainConfig, out_dir: Path | None, progress: bool = True, evaluate_after: bool = True) -> dict:
    """Train from scratch; returns the card (losses, accuracy). Writes the checkpoint when ``out_dir``."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    problems = {
        k: tiny_problems(k, cfg.train_problems, seed=cfg.seed, split="train")  # type: ignore[arg-type]
        for k in ("arith", "countdown")
    }  # type: ignore[arg-type]
    seqs = build_sequences(problems)
    tok = train_tokenizer([trace_text(s) for s in seqs])
    data = encode(seqs, tok, cfg.max_len)
    model = build_model(tok, TinyConfig())
    losses, train_s = fit(model, tok, data, cfg, progress, "train-tiny")
    card: dict = {
        "config": asdict(cfg),
        "model": asdict(TinyConfig()),
        "sequences": len(seqs),
        "mix": {fmt: list(kinds) for fmt, kinds in MIX.items()},
        **run_facts(model, tok, losses, train_s),
        "losses": losses,
    }
    if evaluate_after:
        from zoo.tiny.evaluate import evaluate

        record_heldout(card, lambda: evaluate(model, tok, eval_sets(cfg)))
    if out_dir is not None:
        save(model, tok, card, out_dir)
    return card


def fit(model, tok, data: list[tuple[list[int], list[int]]], cfg: TrainConfig, progress: bool, desc: str):  # type: ignore[no-untyped-def]
    """AdamW with warm-up and cosine decay on ``data`` (ids, labels), batches of similar lengths;
    returns (per-step losses, seconds). Shared by the tiny and the search model (zoo/search/train.py)."""
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
    """What every built-in model's card records of its training run (tiny, search, stream)."""
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


def finish_finetune(  # type: ignore[no-untyped-def]
    card: dict,
    model,
    tok,
    losses: list[float],
    seconds: float,
    heldout: Callable[[], dict[str, FormatResult]] | None,
    out_dir: Path | None,
    card_md: Callable[[dict], str],
) -> dict:
    """The end the fine-tune recipes share (zoo/search/stream.py, reflect.py, deep_train.py): the run's
    facts and its loss every 50 steps on ``card``, the held-out evaluation when ``heldout`` is given,
    the checkpoint with ``card_md(card)`` when ``out_dir`` is."""
    card.update(run_facts(model, tok, losses, seconds))
    card["loss_every_50"] = [round(x, 4) for x in losses[::50]]
    if heldout is not None:
        record_heldout(card, heldout)
    if out_dir is not None:
        write_checkpoint(model, tok, out_dir, card, card_md(card))
    return card


def card_markdown(
    card: dict, title: str, about: list[str], data: list[str], trained_on: str, heldout: str
) -> str:
    """A checkpoint's MODEL_CARD.md (the tiny and the search model's): ``title``, the ``about``
    paragraph (what it learned, how to reproduce it), the model's size, its ``data`` lines, the
    training run (``trained_on``: the threads or the device), and the ``heldout`` table of held-out
    accuracy, a row per format."""
    cfg = card["config"]
    lines = [
        f"# {title}",
        "",
        *about,
        "",
        f"- parameters: {card['params']:,}; vocabulary: {card['vocab_size']} (byte-level BPE, single digits)",
        f"- architecture: {card['model']}",
        *data,
        f"- steps {cfg['steps']}, batch {cfg['batch_size']}, lr {cfg['lr']}, seed {cfg['seed']}",
        f"- training time: {card['train_seconds']} s on {trained_on}; final loss {card['final_loss']}",
        "",
        f"## {heldout}",
        "",
        "| format | accuracy | parsed | total |",
        "|---|---|---|---|",
    ]
    for fmt, r in card.get("heldout", {}).items():
        lines.append(f"| {fmt} | {r['accuracy']:.3f} | {r['parsed']} | {r['total']} |")
    return "\n".join(lines) + "\n"


def print_card(card: dict) -> None:
    """What ``loom train-tiny`` and ``loom train-search`` print when done."""
    print(f"params {card['params']:,}  train {card['train_seconds']} s  final loss {card['final_loss']}")
    for fmt, r in card.get("heldout", {}).items():
        print(
            f"held-out {fmt:8s} accuracy {r['accuracy']:.3f}"
            f" ({r['correct']}/{r['total']}, parsed {r['parsed']})"
        )


def write_checkpoint(model, tok, out_dir: Path, card_json: dict, card_md: str) -> None:  # type: ignore[no-untyped-def]
    """Weights (safetensors), the tokenizer, card.json (without the held-out ``samples``, which only
    ``train`` returns) and MODEL_CARD.md in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    slim = {k: v for k, v in card_json.items() if k != "samples"}
    (out_dir / "card.json").write_text(json.dumps(slim, indent=2) + "\n")
    (out_dir / "MODEL_CARD.md").write_text(card_md)


def save(model, tok, card: dict, out_dir: Path) -> None:  # type: ignore[no-untyped-def]
    slim = {k: v for k, v in card.items() if k != "losses"}
    slim["loss_every_100"] = [round(x, 4) for x in card["losses"][::100]]
    write_checkpoint(model, tok, out_dir, slim, model_card(card))


def model_card(card: dict) -> str:
    cfg = card["config"]
    about = [
        "A small Llama trained from scratch by `loom train-tiny` on Loom's synthetic tasks",
        "(zoo/tiny/tasks.py) in every trace format (zoo/tiny/traces.py). Reproduce with",
        f"`loom train-tiny --seed {cfg['seed']} --steps {cfg['steps']}`.",
    ]
    data = [f"- data mix (format: kinds): {card['mix']}; {card['sequences']} training sequences"]
    threads = f"{card['torch_threads']} torch thread(s)"
    return card_markdown(card, "Loom tiny model", about, data, threads, "Held-out greedy accuracy")


def training_parser(prog: str, description: str, d: TrainConfig) -> argparse.ArgumentParser:
    """The flags ``loom train-tiny`` and ``loom train-search`` share, with ``d``'s defaults
    (``shared_config`` reads them back)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--eval-problems", type=int, default=d.eval_problems)
    p.add_argument("--out", type=Path, default=None, help="default: the package checkpoint directory")
    p.add_argument("--no-eval", action="store_true")
    return p


def shared_config(args: argparse.Namespace) -> dict[str, Any]:
    """The ``TrainConfig`` fields of ``training_parser``'s flags."""
    names = ("seed", "steps", "batch_size", "lr", "eval_problems")
    return {name: getattr(args, name) for name in names}


def main(argv: Sequence[str] | None = None) -> int:
    d = TrainConfig()
    args = training_parser("loom train-tiny", "reproduce the built-in tiny model", d).parse_args(argv)
    configure_process()
    from zoo.tiny import CHECKPOINT_DIR

    cfg = TrainConfig(**shared_config(args))
    print_card(train(cfg, args.out or CHECKPOINT_DIR, evaluate_after=not args.no_eval))
    return 0
