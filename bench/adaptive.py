"""Adaptive (Reinforce-Ada) vs uniform sampling at equal update group size n, on a SIMULATED pass-rate
distribution and on the TINY MODEL (Reinforce-Ada Fig. 2 / Tab. 2 in miniature): the fraction of
prompts whose update group has non-zero reward variance (a learning signal), and the responses sampled
per prompt.

Pass rates are drawn from Beta(a, b) (default a=b=0.35: most prompts are nearly always or nearly
never solved, as in the paper's Fig. 2); a response is correct with its prompt's pass rate. The same
prompts and the same random stream feed every method, side by side in one run.

Tiny model (``--tiny``, on by default): real generation with a built-in checkpoint (``--model tiny``,
the default, or ``search``, the model trained on Countdown search traces, or a checkpoint directory)
through the in-process torch engine (rollout_svc's TorchEngine, plain mode prompts) on the model's own
Countdown problems (``zoo.tiny.tiny_problems``; the search model's ``zoo.search.search_problems``)
at temperature 1.0, scored by the exact verifier (boxed answer after ``</think>``, loom.exact via
``Problem.verify``); the rounds and the down-sampling are gateway/adaptive.py's. Every method gets the
same prompts; each (method, prompt, round) has its own sampling seed.

    python bench/adaptive.py [--prompts 2000] [--n 4] [--M 8] [--R 4] [--alpha 0.35] [--beta 0.35]
                             [--tiny/--no-tiny] [--model tiny|search|DIR] [--tiny-prompts 40]
                             [--max-tokens 64 (tiny) / 256 (search)]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from statistics import pvariance

from gateway.adaptive import AdaptiveConfig, Sampler, run_rounds, select

# sample(active prompt indices, round, m) -> m rewards (with no payload) for each active prompt
Sample = Callable[[list[int], int, int], list[list[tuple[float, None]]]]
Row = tuple[str, float, float, int, int]


def with_m(sample: Sample, m: int) -> Sampler[None]:
    """``sample`` as a gateway.adaptive Sampler drawing ``m`` responses per active prompt."""

    def draw(active: list[int], rnd: int) -> list[list[tuple[float, None]]]:
        return sample(active, rnd, m)

    return draw


def compare(n_prompts: int, make_sampler: Callable[[int], Sample], args: argparse.Namespace) -> list[Row]:
    """Uniform n, uniform M*R and Reinforce-Ada positive/balanced on the same prompts.

    ``make_sampler(method index)`` returns a fresh sampler for one method.
    Row: (method, fraction of prompts with a non-zero-variance update group, samples per prompt,
    prompts dropped, rounds used).
    """
    rows: list[Row] = []
    method = 0
    for label, n_uniform in [
        (f"uniform GRPO n={args.n}", args.n),
        (f"uniform n={args.M * args.R}", args.M * args.R),
    ]:
        cfg = AdaptiveConfig(n=n_uniform, samples_per_round=n_uniform, max_rounds=1)
        pools, c = run_rounds(n_prompts, with_m(make_sampler(method), n_uniform), cfg)
        method += 1
        signal = sum(1 for pool in pools if pvariance(pool.rewards) > 0) / n_prompts
        rows.append((label, signal, c.samples_per_prompt, 0, 1))
    for exit_rule in ("positive", "balanced"):
        cfg = AdaptiveConfig(n=args.n, samples_per_round=args.M, max_rounds=args.R, exit=exit_rule)
        pools, c = run_rounds(n_prompts, with_m(make_sampler(method), args.M), cfg)
        method += 1
        chosen = select(pools, cfg, c)
        signal = (
            sum(
                1 for i, ch in enumerate(chosen) if ch and pvariance([pools[i].rewards[j] for j in ch[1]]) > 0
            )
            / n_prompts
        )
        rows.append(
            (
                f"Reinforce-Ada-{exit_rule[:3]} (M={args.M},R={args.R})",
                signal,
                c.samples_per_prompt,
                c.dropped,
                c.rounds_used,
            )
        )
    return rows


def simulated(args: argparse.Namespace) -> list[Row]:
    rng = random.Random(args.seed)
    rates = [rng.betavariate(args.alpha, args.beta) for _ in range(args.prompts)]

    def make_sampler(method: int) -> Sample:
        r = random.Random(args.seed + 1)  # the same stream for every method

        def sample(active: list[int], rnd: int, m: int) -> list[list[tuple[float, None]]]:
            return [[(1.0 if r.random() < rates[i] else 0.0, None) for _ in range(m)] for i in active]

        return sample

    return compare(args.prompts, make_sampler, args)


def tiny(args: argparse.Namespace) -> tuple[list[Row], dict[str, float]]:
    """The same comparison with real generation and exact scoring on a built-in model (``--model``)."""
    from loom.runtime import configure_process

    configure_process()
    from loom.answers import last_boxed
    from loom.contracts.wire import SamplingParams
    from rollout_svc.engines.torch import TorchEngine
    from zoo.registry import resolve_model_path
    from zoo.tiny import plain_prompt, tiny_problems

    path = resolve_model_path(args.model)
    if not (path / "config.json").exists():
        raise SystemExit(f"no model at {path} (the search model appears after `loom train-search`)")
    engine = TorchEngine(path, cache_entries=0)
    tok = engine.tokenizer
    if args.model == "search":
        from zoo.search import search_problems

        problems = search_problems("countdown", args.tiny_prompts, seed=args.seed, split="train")
    else:
        problems = tiny_problems("countdown", args.tiny_prompts, seed=args.seed, split="train")
    prompt_ids = [tok.encode(plain_prompt(p), add_special_tokens=False) for p in problems]
    info = {"samples": 0.0, "correct": 0.0, "seconds": 0.0}

    def make_sampler(method: int) -> Sample:
        def sample(active: list[int], rnd: int, m: int) -> list[list[tuple[float, None]]]:
            out = []
            for i in active:
                params = SamplingParams(
                    n=m,
                    temperature=1.0,
                    max_tokens=args.max_tokens,
                    seed=args.seed * 1_000_003 + method * 100_003 + i * 101 + rnd,
                )
                t0 = time.perf_counter()
                completions = engine.generate_sync(prompt_ids[i], params)
                info["seconds"] += time.perf_counter() - t0
                rewards = []
                for c in completions:
                    text = str(tok.decode(c.token_ids, skip_special_tokens=True))
                    answer = last_boxed(text) if "</think>" in text else None
                    rewards.append((1.0 if problems[i].verify(answer) else 0.0, None))
                info["samples"] += m
                info["correct"] += sum(r for r, _ in rewards)
                out.append(rewards)
            return out

        return sample

    return compare(len(problems), make_sampler, args), info


def print_rows(rows: list[Row]) -> None:
    print(f"{'method':<34}{'signal groups':>14}{'samples/prompt':>16}{'dropped':>9}{'rounds':>8}")
    for label, signal, spp, dropped, rounds in rows:
        print(f"{label:<34}{signal:>14.3f}{spp:>16.2f}{dropped:>9}{rounds:>8}")
    base = rows[0]
    for label, signal, spp, _, _ in rows[1:]:
        ratio = f"x{signal / base[1]:.2f}" if base[1] > 0 else "n/a (baseline 0)"
        print(f"{label}: signal {ratio}, samples x{spp / base[2]:.2f} vs {base[0]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--M", type=int, default=8)
    p.add_argument("--R", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.35)
    p.add_argument("--beta", type=float, default=0.35)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=True, help="tiny-model part")
    p.add_argument("--model", default="tiny", help="model of the real-generation part: tiny | search | DIR")
    p.add_argument("--tiny-prompts", type=int, default=40, help="Countdown prompts for the model")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="max new tokens per response (default 64; 256 for the search model, whose searches are longer)",
    )
    args = p.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 256 if args.model == "search" else 64

    sim = simulated(args)
    print(f"simulated pass rates: Beta({args.alpha}, {args.beta}), {args.prompts} prompts, n={args.n}")
    print_rows(sim)
    if not args.tiny:
        return
    t0 = time.perf_counter()
    real, info = tiny(args)
    print()
    print(
        f"{args.model} model: {args.tiny_prompts} Countdown prompts (train split), temperature 1.0,"
        f" max_tokens {args.max_tokens}, exact verifier, n={args.n}"
        f" ({int(info['samples'])} samples, pass rate {info['correct'] / max(1.0, info['samples']):.3f},"
        f" {time.perf_counter() - t0:.0f} s)"
    )
    print_rows(real)
    print()
    print("side by side (signal groups | samples/prompt):")
    label = f"{args.model} model" if args.model in ("tiny", "search") else "model"
    print(f"{'method':<34}{'simulated':>20}{label:>20}")
    for s, r in zip(sim, real, strict=True):
        print(f"{s[0]:<34}{s[1]:>9.3f} | {s[2]:>7.2f}{r[1]:>9.3f} | {r[2]:>7.2f}")


if __name__ == "__main__":
    main()
