"""The torch engine against transformers' ``generate`` over a sweep of model shapes, batch sizes and
generation lengths, in one run (docs/benchmarks/engine.md, "Sweep").

Every cell is ``engine_vs_hf.compare``: random-weight Llama / Qwen2 bodies built from transformers'
config classes, float32, one torch thread for both sides (set here, ``torch.set_num_threads(1)``),
16-token distinct prompts, sampling at T = 1 over the whole vocabulary on both sides, every row
exactly the cell's token count (``ignore_eos``; no EOS on ``generate``), each row its own engine
request, the two sides alternating which goes first; the ratio is of medians of wall-clock tokens/s,
beside it the ratio of tokens per CPU-second of the process (what a loaded machine disturbs least).

    python bench/engine_sweep.py [--reps 3] [--quick] [--only mha-384x6]

The cells are chosen so the sweep runs in about 10 minutes on the project's 2-core VM when it is
quiet: the large bodies get the small batches and short generations. ``--quick`` runs two tiny cells
once (the smoke test, tests/bench/test_engine_sweep.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/ is scripts, not a package

from bench.engine_vs_hf import Body, build, compare, n_params  # noqa: E402
from rollout_svc.engines.torch import load_tokenizer, resolve_model_path  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    body: Body
    cells: tuple[tuple[int, int], ...]  # (rows, tokens)


SHAPES = (
    # the shape: hidden 384, 6 layers, full multi-head attention
    Shape(
        "mha-384x6",
        Body(hidden=384, layers=6, heads=6, kv_heads=6, intermediate=1536),
        ((8, 32), (32, 32), (128, 32), (8, 256), (32, 256)),
    ),
    Shape(
        "gqa-256x4",
        Body(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=1024),
        ((8, 32), (128, 32), (8, 256), (128, 256)),
    ),
    Shape(
        "mha-512x12",
        Body(hidden=512, layers=12, heads=8, kv_heads=8, intermediate=1408),
        ((32, 32), (128, 32), (8, 256)),
    ),
    # Qwen2-0.5B's body (hidden 896, 24 layers, 14 heads, 2 KV heads) on Loom's small vocabulary
    Shape(
        "qwen2-gqa-896x24",
        Body(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, family="qwen2"),
        ((8, 32),),
    ),
    # a real vocabulary (Qwen2's 151,936 entries) on the small body: the sampling's per-entry work
    Shape(
        "gqa-256x4-v152k",
        Body(hidden=256, layers=4, heads=8, kv_heads=2, intermediate=1024, vocab=151936),
        ((8, 32), (32, 32)),
    ),
)

QUICK = (
    Shape("quick-gqa-128x2", Body(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256), ((4, 8),)),
    Shape(
        "quick-mha-128x2",
        Body(hidden=128, layers=2, heads=4, kv_heads=4, intermediate=256, family="qwen2"),
        ((8, 8),),
    ),
)


def sweep(shapes: tuple[Shape, ...], reps: int, warmup: int = 4) -> list[dict[str, Any]]:
    """Every cell of every shape: ``compare``'s result with the shape's name and size, and the
    cell's seconds."""
    tokenizer = load_tokenizer(resolve_model_path("tiny"))
    results = []
    for shape in shapes:
        model = build(shape.body, len(tokenizer), "cpu", torch.float32)
        for rows, tokens in shape.cells:
            t = time.perf_counter()
            r = compare(model, tokenizer, rows, tokens, reps, "cpu", warmup=warmup)
            r.update(shape=shape.name, params=n_params(model), seconds=time.perf_counter() - t)
            results.append(r)
            print_row(r, flush=True)
    return results


HEAD = (
    f"| {'shape':<17} | {'M params':>8} | {'rows x tokens':<13} | {'engine tok/s':>12} | {'HF tok/s':>9} "
    f"| {'ratio':>5} | {'CPU-time ratio':>14} | per-rep ratios | s |"
)


def print_row(r: dict[str, Any], flush: bool = False) -> None:
    cell = f"{r['rows']} x {r['tokens']}"
    reps = " ".join(f"{x:.2f}" for x in r["ratios"])
    print(
        f"| {r['shape']:<17} | {r['params'] / 1e6:8.1f} | {cell:<13} | {r['engine']:12.1f} | {r['hf']:9.1f} "
        f"| {r['ratio']:5.2f} | {r['cpu_ratio']:14.2f} | {reps} | {r['seconds']:.0f} |",
        flush=flush,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="two tiny cells, one rep (a smoke test)")
    ap.add_argument("--only", nargs="+", default=None, help="the shapes to run (by name)")
    a = ap.parse_args()
    torch.set_num_threads(1)  # both sides on one thread, on purpose (docs/benchmarks/engine.md)
    shapes = QUICK if a.quick else SHAPES
    if a.only:
        shapes = tuple(s for s in shapes if s.name in a.only)
    reps = 1 if a.quick else a.reps
    print(
        f"engine vs HF generate, sweep: float32, cpu, torch threads {torch.get_num_threads()}, "
        f"T=1, {reps} reps (median); {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    print(HEAD)
    print("|" + "---|" * 9)
    t = time.perf_counter()
    results = sweep(shapes, reps, warmup=1 if a.quick else 4)
    ratios = [r["ratio"] for r in results]
    cpu = [r["cpu_ratio"] for r in results]
    print(
        f"cells {len(results)}: ratio min {min(ratios):.2f} median {statistics.median(ratios):.2f}; "
        f"CPU-time ratio min {min(cpu):.2f} median {statistics.median(cpu):.2f}; "
        f"{time.perf_counter() - t:.0f} s; load average at the end {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
