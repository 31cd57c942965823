"""The learner close to the hardware (issue 37): full fine-tuning, LoRA and packed, side by side.

``learner_rows(device)`` trains one synthetic GRPO batch with each variant on a random-weight Llama
(``bench/learner.py`` ``SIZES``) and returns one dict per row; ``bench/gpu.py`` imports it for
docs/benchmarks/gpu.md, and ``python bench/gpu_learner.py [--device cuda]`` prints the rows.

- CUDA: the 1 B TinyLlama shape (hidden 2048, 22 layers, 32 heads / 4 KV heads, vocab 32000), bf16
  autocast with float32 master weights, 16 groups x 8 trajectories x ~400 tokens, 8,192-token
  micro-batches. Rows: ``full`` (padded, the whole logits: the learner before issue 37), ``lora`` (r = 8
  on q/k/v/o, packed), ``packed`` (full fine-tuning, packed rows + the fused chunked head), and
  ``packed 32k`` (one 32,768-token micro-batch, no activation checkpointing: does it fit?); on request
  (``--variants``) ``packed inductor`` (each decoder layer under ``torch.compile``'s inductor),
  ``packed rowmask`` (sdpa over each packed row with its block mask, not one sdpa per trajectory) and
  ``packed rowmask inductor`` (both).
- CPU: the same rows at the ~10 M size (``10m``) on 2 groups x 8 x ~200 tokens, one torch thread; the
  32,768-token row is left out there (host memory says nothing about a card's).

Per row: the median step seconds and tokens/s of ``steps`` steps after a warm-up (publishing excluded),
MFU = 6 N tokens/s over the card's dense bf16 peak (``DENSE_BF16``; N = all parameters, the issue's
convention: a LoRA step does less work than 6 N, so its MFU is an upper reading), the peak memory
(``torch.cuda.max_memory_allocated`` on CUDA, on CPU the growth of the peak RSS), and for the 32k row
whether it ran (``fits``; an out-of-memory error is a row with ``fits: False``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # `python bench/gpu_learner.py`: the repository root, not bench/, on the path
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.learner import SIZES, _peak, _reset_peak, build_checkpoint, make_batch  # noqa: E402
from loom.contracts.wire import TrainBatch  # noqa: E402

# dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name()
DENSE_BF16 = (
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)

VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"packing": False, "logprob_chunk": 0},
    "lora": {"lora_rank": 8},
    "packed": {},
    "packed 32k": {"token_budget": 32_768},
    "packed inductor": {"torch_compile": "inductor"},
    "packed rowmask": {"segment_attention": False},
    "packed rowmask inductor": {"segment_attention": False, "torch_compile": "inductor"},
}
DEFAULT_VARIANTS = ("full", "lora", "packed", "packed 32k")  # the others on request (--variants)


def dense_bf16_peak(device_name: str) -> float | None:
    return next((peak for key, peak in DENSE_BF16 if key in device_name), None)


def learner_rows(
    device: str,
    steps: int = 3,
    variants: tuple[str, ...] = DEFAULT_VARIANTS,
    report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One dict per variant: name, device, size, params, tokens, micro-batch budget, step_s,
    tokens_per_s, mfu (None where the peak is unknown, e.g. CPU), peak_gib, fits, note. ``report``
    is called with each row as soon as it is measured (a run cut short keeps the rows it made)."""
    import torch

    from learner.config import LearnerSettings
    from learner.train import Learner

    on_cuda = device.startswith("cuda")
    size_name = "1b" if on_cuda else "10m"
    size = SIZES[size_name]
    if not on_cuda:
        torch.set_num_threads(1)
        variants = tuple(v for v in variants if v != "packed 32k")
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    peak_flops = dense_bf16_peak(name) if on_cuda else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / f"llama-{size_name}"
        n_params = build_checkpoint(size, path)
        groups, rewards = make_batch(16, 8, 500, size.vocab) if on_cuda else make_batch(2, 8, 250, size.vocab)
        tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for g in groups for t in g.trajectories)
        for variant in variants:
            kw = {"token_budget": 8192, **VARIANTS[variant]}
            row: dict[str, Any] = {
                "variant": variant,
                "device": name,
                "size": size_name,
                "params": n_params,
                "tokens": tokens,
                "token_budget": kw["token_budget"],
                "mixed_precision": "bf16" if on_cuda else "no",
                "step_s": None,
                "tokens_per_s": None,
                "mfu": None,
                "peak_gib": None,
                "fits": None,
                "note": "",
            }
            rows.append(row)
            baseline = _reset_peak(torch.device(device))
            learner = None
            try:
                learner = Learner(
                    LearnerSettings(
                        model=path,
                        store=root / variant.replace(" ", "_"),
                        device=device,
                        mixed_precision="bf16" if on_cuda else "no",
                        save_optimizer=False,
                        keep_versions=1,
                        **kw,
                    )
                )
                times, tps = [], []
                for step in range(steps + 1):  # step 0 is warm-up
                    res = learner.train_step(TrainBatch(step=step, groups=groups, rewards=rewards))
                    if step > 0:
                        times.append(res.metrics["train_seconds"])
                        tps.append(res.metrics["tokens_per_s"])
                row["step_s"], row["tokens_per_s"] = statistics.median(times), statistics.median(tps)
                row["fits"] = True
                if peak_flops:
                    row["mfu"] = 6 * n_params * row["tokens_per_s"] / peak_flops
            except torch.OutOfMemoryError as exc:
                row["fits"] = False
                row["note"] = f"out of memory: {str(exc).splitlines()[0][:120]}"
            row["peak_gib"] = _peak(torch.device(device), baseline) / 2**30
            del learner
            gc.collect()
            if report is not None:
                report(row)
    return rows


HEADER = (
    "| variant | device | size | tokens/step | micro-batch tokens | step s | tokens/s | MFU | peak GiB "
    "| fits |\n|---|---|---|---|---|---|---|---|---|---|"
)


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        step = f"{r['step_s']:.3f}" if r["step_s"] is not None else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
        mfu = f"{100 * r['mfu']:.1f} %" if r["mfu"] is not None else "-"
        print(
            f"| {r['variant']} | {r['device']} | {r['size']} ({r['params'] / 1e6:.0f} M) | {r['tokens']} | "
            f"{r['token_budget']} | {step} | {tps} | {mfu} | {r['peak_gib']:.2f} | {r['fits']} {r['note']} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {', '.join(VARIANTS)}")
    args = p.parse_args()
    from loom.runtime import configure_process

    configure_process()
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"unknown variants {sorted(unknown)}")
    print(HEADER, flush=True)
    learner_rows(args.device, args.steps, variants, report=lambda row: print_rows([row]))


if __name__ == "__main__":
    main()
