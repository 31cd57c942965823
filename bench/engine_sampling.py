"""What vLLM's sampling fields cost the torch engine: tokens/s of plain sampling against the same
requests with the penalties (repetition, presence, frequency), min_p and min_tokens set, and against
token streaming (``Engine.stream``, what ``stream=true`` on the OpenAI routes uses), on the TINY MODEL
in-process, side by side in one run (the three kinds interleaved, the median of the repetitions).

    python bench/engine_sampling.py [--prompts 8] [--n 4] [--max-tokens 64] [--reps 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from loom.contracts.wire import SamplingParams
from loom.runtime import configure_process
from rollout_svc.engines.torch import TorchEngine, resolve_model_path

PROMPT = [61, 383, 63, 347, 223, 22, 25, 13, 26, 23, 16, 201]  # "[plain] Compute 47+85.\n"


async def plain(engine: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> int:
    outs = await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params, strict=True)))
    return sum(len(c.token_ids) for o in outs for c in o)


async def streamed(engine: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> int:
    async def one(p: list[int], q: SamplingParams) -> int:
        return sum([1 async for _ in engine.stream(p, q)])

    return sum(await asyncio.gather(*(one(p, q) for p, q in zip(prompts, params, strict=True))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    configure_process()
    engine = TorchEngine(resolve_model_path("tiny"), cache_entries=0)
    prompts = [PROMPT[:5] + [22 + i % 5] + PROMPT[6:] for i in range(a.prompts)]
    base = SamplingParams(n=a.n, max_tokens=a.max_tokens, temperature=1.0)
    fields = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.05}
    kinds: dict[str, tuple[Any, SamplingParams]] = {
        "plain": (plain, base),
        "processors": (plain, base.model_copy(update={**fields, "min_tokens": a.max_tokens // 4})),
        "streamed": (streamed, base),
    }
    rates: dict[str, list[float]] = {k: [] for k in kinds}
    for rep in range(a.reps):
        order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
        for kind in order:
            run, params = kinds[kind]
            seeded = [params.model_copy(update={"seed": 1000 * rep + i}) for i in range(a.prompts)]
            t = time.perf_counter()
            tokens = asyncio.run(run(engine, prompts, seeded))
            rates[kind].append(tokens / (time.perf_counter() - t))
    engine.stop_scheduler()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"{a.prompts} prompts x n={a.n}, {a.max_tokens} tokens, {a.reps} repetitions, tiny model")
    for k, v in rates.items():
        print(f"  {k:<11} {med[k]:8.1f} tokens/s (median; {', '.join(f'{x:.0f}' for x in v)})")
    print(f"  processors / plain: {med['processors'] / med['plain']:.3f}")
    print(f"  streamed / plain:   {med['streamed'] / med['plain']:.3f}")


if __name__ == "__main__":
    main()
