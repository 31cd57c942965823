"""Multi-LoRA on the torch engine: 4 LoRA adapters of the TINY MODEL batched in one forward (their
requests decode together, every row its own adapter: ``rollout_svc/engines/torch/lora.py``) against
the same requests served one adapter after another, each by an engine over a copy of the base with
that adapter merged (what a replica that holds one version at a time does at best: the merge and the
swap are not counted). Tokens/s side by side in one run (the two kinds interleaved, the median of the
repetitions); every request samples exactly ``--max-tokens`` tokens (``min_tokens``), so both kinds
do the same work. Target: batched / one after another >= 2.5 on CPU (docs/benchmarks/multilora.md).

    python bench/multilora.py [--adapters 4] [--prompts 2] [--n 2] [--max-tokens 48] [--reps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from loom.contracts.wire import SamplingParams
from loom.runtime import set_torch_threads
from rollout_svc.engines.torch import TorchEngine, resolve_model_path

PROMPT = [61, 383, 63, 347, 223, 22, 25, 13, 26, 23, 16, 201]  # "[plain] Compute 47+85.\n"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_adapters(root: Path, count: int, rank: int) -> list[Path]:
    """``count`` random peft LoRA adapters of the tiny model (real peft classes, saved to disk)."""
    from peft import LoraConfig, get_peft_model

    from zoo.tiny import load_model

    out = []
    for i in range(count):
        torch.manual_seed(100 + i)
        model = get_peft_model(load_model(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        model.save_pretrained(str(root / f"a{i}"))
        out.append(root / f"a{i}")
    return out


async def serve(jobs: list[tuple[Any, list[int], SamplingParams]]) -> int:
    outs = await asyncio.gather(*(e.generate(p, q) for e, p, q in jobs))
    return sum(len(c.token_ids) for o in outs for c in o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=2, help="requests per adapter")
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (set on purpose)")
    a = ap.parse_args()
    set_torch_threads(a.threads)
    base = TorchEngine(resolve_model_path("tiny"), cache_entries=0)
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(Path(tmp), a.adapters, a.rank)
        views = [base.adapted_sync(str(f)) for f in folders]  # batched: views of one engine
        merged = [TorchEngine(base.model_path, cache_entries=0, model=_merged(base, f)) for f in folders]
    prompts = [PROMPT[:5] + [22 + i % 5] + PROMPT[6:] for i in range(a.prompts)]
    rates: dict[str, list[float]] = {"batched": [], "one after another": []}
    for rep in range(a.reps):
        params = [
            SamplingParams(
                n=a.n, max_tokens=a.max_tokens, min_tokens=a.max_tokens, temperature=1.0, seed=rep * 100 + i
            )
            for i in range(a.prompts)
        ]
        for kind in list(rates) if rep % 2 == 0 else list(reversed(rates)):
            t = time.perf_counter()
            if kind == "batched":
                tokens = asyncio.run(
                    serve([(v, p, q) for v in views for p, q in zip(prompts, params, strict=True)])
                )
            else:
                tokens = sum(
                    asyncio.run(serve([(e, p, q) for p, q in zip(prompts, params, strict=True)]))
                    for e in merged
                )
            rates[kind].append(tokens / (time.perf_counter() - t))
    for e in [base, *merged]:
        e.stop_scheduler()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{a.adapters} adapters (r={a.rank}, {'/'.join(TARGETS)}) x {a.prompts} requests x n={a.n}, "
        f"{a.max_tokens} tokens each, {a.reps} repetitions, tiny model, {a.threads} torch thread(s)"
    )
    for k, v in rates.items():
        print(f"  {k:<18} {med[k]:8.1f} tokens/s (median; {', '.join(f'{x:.0f}' for x in v)})")
    print(f"  batched / one after another: {med['batched'] / med['one after another']:.2f}x (target >= 2.5)")


def _merged(base: TorchEngine, folder: Path) -> Any:
    from rollout_svc.engines.torch.model import merge_adapter

    return merge_adapter(base.model, folder, base.model_path)


if __name__ == "__main__":
    main()
