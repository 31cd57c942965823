"""The torch engine against transformers' ``generate`` on the same random-weight Llama: tokens/s of
both sides side by side in one run, at several batch sizes (rows in flight), sampling at T = 1 over
the whole vocabulary, every row generating exactly ``--tokens`` tokens (``ignore_eos`` on the engine,
no EOS id on ``generate``), so both do equal work. Each row is its own request to the engine (n=1,
distinct prompts of equal length), as ``generate`` gets a batch of distinct prompts. The two sides
run interleaved; the ratio is of medians of wall-clock tokens/s, and beside it the ratio of tokens per
CPU-second of the process (what a loaded machine disturbs least).

    python bench/engine_vs_hf.py [--rows 32 128] [--tokens 64] [--reps 2] [--dtype float32]

The default body is a ~10 M-parameter Llama (hidden 256, 10 layers) with Loom's tokenizer, one torch
thread (``configure_process``). ``bench/gpu.py`` reuses ``compare`` with the 0.5 B body on CUDA.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from loom.contracts.wire import SamplingParams
from loom.runtime import configure_process
from rollout_svc.engines.torch import TorchEngine, load_tokenizer, resolve_model_path

PROMPT_LEN = 16


@dataclass(frozen=True)
class Body:
    """A Llama-family body: the shape of the model the bench builds with random weights."""

    hidden: int = 256
    layers: int = 10
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1024
    vocab: int | None = None  # None: Loom's tokenizer's vocabulary
    family: str = "llama"  # "llama" or "qwen2"


SMALL = Body()
QWEN2_05B = Body(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, family="qwen2")


def build(body: Body, vocab: int, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = kind[body.family]
    config = config_cls(
        vocab_size=body.vocab or vocab,
        hidden_size=body.hidden,
        intermediate_size=body.intermediate,
        num_hidden_layers=body.layers,
        num_attention_heads=body.heads,
        num_key_value_heads=body.kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = model_cls(config)
    model.set_attn_implementation("sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(device=device, dtype=dtype).eval()


def n_params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_rate(model: Any, prompts: torch.Tensor, tokens: int, seed: int) -> tuple[float, float]:
    """tokens/s of ``generate`` over the batch ``prompts`` (rows, prompt length): per second of wall
    clock and per second of this process's CPU time."""
    torch.manual_seed(seed)
    device = str(prompts.device)
    _sync(device)
    t, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            pad_token_id=0,
        )
    _sync(device)
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    made = (out.shape[1] - prompts.shape[1]) * out.shape[0]
    assert made == prompts.numel() // prompts.shape[1] * tokens, made
    return made / elapsed, made / cpu


def engine_rate(engine: TorchEngine, prompts: list[list[int]], tokens: int, seed: int) -> tuple[float, float]:
    """tokens/s of the engine with every prompt its own concurrent request (n=1), per second of wall
    clock and per second of CPU time (every thread of the process: the scheduler's included)."""
    params = [
        SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=seed + i)
        for i in range(len(prompts))
    ]

    async def go() -> list[Any]:
        return await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params, strict=True)))

    _sync(engine.device)
    t, cpu = time.perf_counter(), time.process_time()
    outs = asyncio.run(go())
    _sync(engine.device)
    elapsed, cpu = time.perf_counter() - t, time.process_time() - cpu
    made = sum(len(c.token_ids) for o in outs for c in o)
    assert made == len(prompts) * tokens, made
    return made / elapsed, made / cpu


def make_engine(model: Any, tokenizer: Any, rows: int, cuda_graphs: bool = False) -> TorchEngine:
    """An engine over ``model`` that may hold ``rows`` rows (the code before issue 37 capped them at
    ``max_batch_rows``; the budgeted engine needs no cap), its decode step in CUDA graphs if asked."""
    kwargs: dict[str, Any] = {"model": model, "tokenizer": tokenizer, "cache_entries": 0}
    params = inspect.signature(TorchEngine).parameters
    if "max_batch_rows" in params:
        kwargs["max_batch_rows"] = rows
    if "cuda_graphs" in params:
        kwargs["cuda_graphs"] = cuda_graphs
    return TorchEngine(resolve_model_path("tiny"), **kwargs)


def compare(
    model: Any,
    tokenizer: Any,
    rows: int,
    tokens: int,
    reps: int,
    device: str,
    warmup: int = 4,
    graphs: bool = False,
) -> dict[str, Any]:
    """Engine and ``generate`` interleaved ``reps`` times on the same prompts (after a short warm-up
    of each; the leg that goes first alternates): the medians and their ratio. ``graphs`` (CUDA):
    a third leg, the engine with its decode step in CUDA graphs (``graphs``, ``graphs_ratio``)."""
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, min(vocab, 50_000), (rows, PROMPT_LEN), generator=g)
    batch, prompts = ids.to(device), ids.tolist()
    engines = {"engine": make_engine(model, tokenizer, rows)}
    if graphs:
        engines["graphs"] = make_engine(model, tokenizer, rows, cuda_graphs=True)
    hf_rate(model, batch, warmup, 0)
    for engine in engines.values():
        engine_rate(engine, prompts, warmup, 0)
    legs = ["hf", *engines]
    runs: dict[str, list[tuple[float, float]]] = {side: [] for side in legs}
    for rep in range(reps):
        for side in legs if rep % 2 == 0 else legs[::-1]:
            if side == "hf":
                runs[side].append(hf_rate(model, batch, tokens, 100 + rep))
            else:
                runs[side].append(engine_rate(engines[side], prompts, tokens, 100 + rep))
    for engine in engines.values():
        engine.stop_scheduler()
    wall = {side: statistics.median(r for r, _ in runs[side]) for side in legs}
    cpu = {side: statistics.median(c for _, c in runs[side]) for side in legs}
    out = {
        "rows": rows,
        "tokens": tokens,
        "engine": wall["engine"],
        "hf": wall["hf"],
        "ratio": wall["engine"] / wall["hf"],
        "cpu_ratio": cpu["engine"] / cpu["hf"],
        "ratios": [e / h for (e, _), (h, _) in zip(runs["engine"], runs["hf"], strict=True)],
        "peak_rows": engines["engine"].stats.extra.get("peak_batch_rows", 0.0),
    }
    if graphs:
        out["graphs"], out["graphs_ratio"] = wall["graphs"], wall["graphs"] / wall["hf"]
        out["graph_error"] = engines["graphs"].scheduler.decode.graph_error
    return out


def print_rows(results: list[dict[str, Any]]) -> None:
    head = (
        f"  {'rows x tokens':<14} {'engine tok/s':>12} {'HF tok/s':>10} {'ratio':>6} {'CPU-time ratio':>15}"
    )
    print(head + "  engine peak rows  per-rep ratios")
    for r in results:
        print(
            f"  {r['rows']:>4} x {r['tokens']:<7} {r['engine']:12.1f} {r['hf']:10.1f} "
            f"{r['ratio']:6.2f} {r['cpu_ratio']:15.2f}  {r['peak_rows']:16.0f}  "
            + " ".join(f"{x:.2f}" for x in r["ratios"])
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    configure_process()
    tokenizer = load_tokenizer(resolve_model_path("tiny"))
    model = build(SMALL, len(tokenizer), a.device, getattr(torch, a.dtype))
    print(
        f"engine vs HF generate: random Llama {n_params(model) / 1e6:.1f} M params, {a.dtype}, {a.device}, "
        f"torch threads {torch.get_num_threads()}, prompt {PROMPT_LEN} tokens, T=1, {a.reps} reps "
        f"(median); {platform.processor() or platform.machine()}, load {os.getloadavg()[0]:.2f}"
    )
    results = [compare(model, tokenizer, rows, a.tokens, a.reps, a.device) for rows in a.rows]
    print_rows(results)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
