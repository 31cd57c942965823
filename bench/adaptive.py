"""Adaptive (Reinforce-Ada) vs uniform sampling at equal update group size n, on a SIMULATED pass-rate
distribution (Reinforce-Ada Fig. 2 / Tab. 2 in miniature): the fraction of prompts whose update group
has non-zero reward variance (a learning signal), and the responses sampled per prompt.

Pass rates are drawn from Beta(a, b) (default a=b=0.35: most prompts are nearly always or nearly
never solved, as in the paper's Fig. 2); a response is correct with its prompt's pass rate. The same
prompts and the same random stream feed every method, side by side in one run.

    python bench/adaptive.py [--prompts 2000] [--n 4] [--M 8] [--R 4] [--alpha 0.35] [--beta 0.35]
"""

from __future__ import annotations

import argparse
import random
from statistics import pvariance

from gateway.adaptive import AdaptiveConfig, run_rounds, select


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=2000)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--M", type=int, default=8)
    p.add_argument("--R", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.35)
    p.add_argument("--beta", type=float, default=0.35)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    rates = [rng.betavariate(args.alpha, args.beta) for _ in range(args.prompts)]

    def sampler(seed: int):  # noqa: ANN202
        r = random.Random(seed)

        def sample(active: list[int], rnd: int, m: int) -> list[list[tuple[float, None]]]:
            return [[(1.0 if r.random() < rates[i] else 0.0, None) for _ in range(m)] for i in active]

        return sample

    print(f"simulated pass rates: Beta({args.alpha}, {args.beta}), {args.prompts} prompts, n={args.n}")
    print(f"{'method':<34}{'signal groups':>14}{'samples/prompt':>16}{'dropped':>9}{'rounds':>8}")
    rows = []
    for label, n_uniform in [
        (f"uniform GRPO n={args.n}", args.n),
        (f"uniform n={args.M * args.R}", args.M * args.R),
    ]:
        s = sampler(args.seed + 1)
        cfg = AdaptiveConfig(n=n_uniform, samples_per_round=n_uniform, max_rounds=1)
        pools, c = run_rounds(args.prompts, lambda a, rnd, s=s, m=n_uniform: s(a, rnd, m), cfg)
        signal = sum(1 for pool in pools if pvariance(pool.rewards) > 0) / args.prompts
        rows.append((label, signal, c.samples_per_prompt, 0, 1))
    for exit_rule in ("positive", "balanced"):
        s = sampler(args.seed + 1)
        cfg = AdaptiveConfig(n=args.n, samples_per_round=args.M, max_rounds=args.R, exit=exit_rule)
        pools, c = run_rounds(args.prompts, lambda a, rnd, s=s: s(a, rnd, args.M), cfg)
        chosen = select(pools, cfg, c)
        signal = (
            sum(
                1 for i, ch in enumerate(chosen) if ch and pvariance([pools[i].rewards[j] for j in ch[1]]) > 0
            )
            / args.prompts
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
    for label, signal, spp, dropped, rounds in rows:
        print(f"{label:<34}{signal:>14.3f}{spp:>16.2f}{dropped:>9}{rounds:>8}")
    base = rows[0]
    for label, signal, spp, _, _ in rows[1:]:
        print(f"{label}: signal x{signal / base[1]:.2f}, samples x{spp / base[2]:.2f} vs {base[0]}")


if __name__ == "__main__":
    main()
