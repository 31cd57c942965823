"""One command for Loom close to the hardware, side by side in one run, written to
docs/benchmarks/gpu.md with the date and the card (issue 37):

1. the torch engine against transformers' ``generate`` (``bench/engine_vs_hf.py``'s ``compare``):
   on CUDA a random body shaped like Qwen2-0.5B (hidden 896, 24 layers, 14 heads, 2 KV heads) in
   bf16 at 64 x 256 and 256 x 128 rows x tokens, the engine eager and with its decode step in CUDA
   graphs (``cuda_graphs=True``) as a third leg; on CPU the ~10 M Llama in float32 at 32 and 128
   rows x 64 tokens (one torch thread);
2. the memory-bound floor of a decode step at those sizes: the weights and the rows' KV cache read
   once per step at the bandwidth measured here (a device-to-device copy), as tokens/s;
3. the learner (``bench/gpu_learner.py``'s ``learner_rows(device)``, when it is there);
4. ``pytest tests/gpu`` (every test skips without a CUDA device).

    python bench/gpu.py [--out docs/benchmarks/gpu.md] [--reps 2] [--no-tests] [--no-learner]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from engine_vs_hf import PROMPT_LEN, QWEN2_05B, SMALL, Body, build, compare, n_params  # noqa: E402

from loom.runtime import configure_process  # noqa: E402
from rollout_svc.engines.torch import load_tokenizer, resolve_model_path  # noqa: E402
from rollout_svc.engines.torch.scheduler import kv_bytes_per_token  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def bandwidth(device: str, mib: int = 1024) -> float:
    """Bytes/s of a device-to-device copy (read + written), the best of five."""
    n = mib * (1 << 20) // 4
    if not device.startswith("cuda"):
        n //= 8  # 128 MiB on the host is enough to leave the caches
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * a.element_size() / best


def floor_rate(model: Any, rows: int, tokens: int, bytes_per_s: float) -> float:
    """tokens/s if a decode step only read the weights and the rows' KV cache (at its mean length)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    kv = rows * (PROMPT_LEN + tokens / 2) * kv_bytes_per_token(model.config, dtype)
    return rows * bytes_per_s / (weights + kv)


def engine_section(device: str, reps: int, graphs: bool = True) -> tuple[list[str], dict[str, Any]]:
    cuda = device.startswith("cuda")
    body: Body = QWEN2_05B if cuda else SMALL
    dtype = torch.bfloat16 if cuda else torch.float32
    sizes = [(64, 256), (256, 128)] if cuda else [(32, 64), (128, 64)]
    tokenizer = load_tokenizer(resolve_model_path("tiny"))
    model = build(body, len(tokenizer), device, dtype)
    bw = bandwidth(device)
    lines = [
        f"Engine vs HF `generate`: random {body.family} body, {n_params(model) / 1e6:.1f} M parameters "
        f"(hidden {body.hidden}, {body.layers} layers, {body.heads} heads, {body.kv_heads} KV heads), "
        f"{str(dtype).removeprefix('torch.')}, prompt {PROMPT_LEN} tokens, T = 1, every row its full length, "
        f"median of {reps}; measured copy bandwidth {bw / 1e9:.0f} GB/s.",
        "",
        "| rows x tokens | Loom engine tok/s | HF generate tok/s | engine / HF | memory-bound floor tok/s | "
        "engine / floor | engine peak rows |",
        "|---|---|---|---|---|---|---|",
    ]
    results = []
    for rows, tokens in sizes:
        r = compare(model, tokenizer, rows, tokens, reps, device, graphs=cuda and graphs)
        r["floor"] = floor_rate(model, rows, tokens, bw)
        results.append(r)
        lines.append(
            f"| {rows} x {tokens} | {r['engine']:,.0f} | {r['hf']:,.0f} | {r['ratio']:.2f} | "
            f"{r['floor']:,.0f} | {r['engine'] / r['floor']:.3f} | {r['peak_rows']:.0f} |"
        )
        if cuda and graphs:  # the same engine with its decode step captured in CUDA graphs (cuda_graphs=True)
            note = f" (capture failed: {r['graph_error']})" if r["graph_error"] else ""
            lines.append(
                f"| {rows} x {tokens}, CUDA graphs{note} | {r['graphs']:,.0f} | {r['hf']:,.0f} | "
                f"{r['graphs_ratio']:.2f} | {r['floor']:,.0f} | {r['graphs'] / r['floor']:.3f} | "
                f"{r['peak_rows']:.0f} |"
            )
        print(lines[-1], flush=True)
    del model
    return lines, {"bandwidth": bw, "rows": results}


def learner_section(device: str) -> list[str]:
    if not (REPO / "bench" / "gpu_learner.py").is_file():
        return ["bench/gpu_learner.py is missing: no learner rows."]
    from gpu_learner import learner_rows  # type: ignore[import-not-found]

    rows: list[dict[str, Any]] = learner_rows(device)
    if not rows:
        return ["The learner section returned no rows."]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{v:,.3g}" if isinstance(v, float) else str(v) for v in (r.get(k, "") for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def tests_section() -> list[str]:
    env = {**os.environ, "LOOM_TORCH_THREADS": os.environ.get("LOOM_TORCH_THREADS", "1")}
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=REPO, env=env, capture_output=True, text=True
    )
    summary = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    return [f"`pytest tests/gpu` (exit {proc.returncode}, {time.perf_counter() - t:.0f} s): {summary[0]}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks" / "gpu.md")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-learner", action="store_true")
    ap.add_argument("--no-graphs", action="store_true", help="leave out the CUDA-graphs leg")
    a = ap.parse_args()
    configure_process()
    device = a.device
    card = torch.cuda.get_device_name(device) if device.startswith("cuda") else f"CPU ({platform.machine()})"
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        f"- date: {when}; device: {card}; torch {torch.__version__}; "
        f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
    ]
    print("\n".join(head), flush=True)
    engine_lines, _ = engine_section(device, a.reps, graphs=not a.no_graphs)
    learner = ["(skipped: --no-learner)"] if a.no_learner else learner_section(device)
    print("\n".join(learner), flush=True)
    tests = ["(skipped: --no-tests)"] if a.no_tests else tests_section()
    print("\n".join(tests), flush=True)
    section = [
        f"## Run on {card}",
        "",
        *head,
        "### Engine",
        "",
        *engine_lines,
        "",
        "### Learner",
        "",
        *learner,
    ]
    section += ["", "### tests/gpu", "", *tests, ""]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    old = a.out.read_text() if a.out.exists() else "# GPU benchmarks (bench/gpu.py)\n\n"
    a.out.write_text(old.rstrip("\n") + "\n\n" + "\n".join(section))
    print(f"appended to {a.out}")


if __name__ == "__main__":
    main()
