"""Benchmark of the shipped tiny model: held-out greedy accuracy per format, and CPU generation speed
(HF generate with the KV cache vs without, side by side in one run).

    loom bench tiny [--problems 40] [--tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from loom.runtime import configure_process
from zoo.tiny import HELDOUT_SEED, load_model, load_tokenizer, plain_prompt, tiny_problems
from zoo.tiny.evaluate import evaluate
from zoo.tiny.model import n_params
from zoo.tiny.train import MIX


def tokens_per_second(model, tok, prompts: list[str], new_tokens: int, use_cache: bool) -> float:  # type: ignore[no-untyped-def]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            **enc,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=tok.pad_token_id,
        )
        dt = time.perf_counter() - t0
    generated = (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)
    return generated / dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--problems", type=int, default=40, help="held-out problems per format and kind")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per sequence for the speed test")
    args = p.parse_args()
    configure_process()
    model, tok = load_model(), load_tokenizer()
    print(
        f"tiny model: {n_params(model):,} parameters, vocabulary {len(tok)},"
        f" torch threads {torch.get_num_threads()}"
    )

    sets = {
        fmt: [
            q for kind in kinds for q in tiny_problems(kind, args.problems, seed=HELDOUT_SEED, split="test")
        ]  # type: ignore[arg-type]
        for fmt, kinds in MIX.items()
    }
    t0 = time.perf_counter()
    results = evaluate(model, tok, sets)
    print(f"held-out greedy accuracy ({time.perf_counter() - t0:.1f} s):")
    for fmt, r in results.items():
        print(f"  {fmt:8s} {r.accuracy:6.3f}  ({r.correct}/{r.total} correct, {r.parsed} parsed)")

    prompts = [plain_prompt(q) for q in tiny_problems("arith", 8, seed=1, split="test")]
    for batch in (1, 8):
        cached = tokens_per_second(model, tok, prompts[:batch], args.tokens, use_cache=True)
        uncached = tokens_per_second(model, tok, prompts[:batch], args.tokens, use_cache=False)
        print(
            f"generate batch {batch}: {cached:8.1f} tok/s with KV cache, {uncached:8.1f} tok/s without"
            f"  (ratio {cached / uncached:.2f}x)"
        )


if __name__ == "__main__":
    main()
