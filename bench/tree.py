"""Tree-mode benchmark (issue 6): tokens the model computes for a tree (prefix reuse through the torch
engine's prefix KV cache) vs independent sampling of the same number of leaves, side by side.

For each prompt (Loom's tiny model, reflect-format arithmetic from the distribution it was trained on:
its steps are blank-line separated), each number of expansion rounds L (``--iterations``, default
1,2,3: TreeRL's EPTree rounds) and each branching strategy: run tree mode (M' = 6, N = 2, T = 2,
L), then plain sampling of as many
responses as the tree has leaves, from the same prompt, on the same engine. "Computed" = prompt tokens
actually prefilled (not served from the cache) + decoded tokens (``engine.stats``). The cache is reset
before each run. Target: tree / independent <= 0.6. Printed beside it: the tree's generated tokens
over the summed lengths of its own leaves (``Group.meta["token_ratio"]``: what sampling exactly those
leaves from scratch would decode; a tree's leaves are longer on average than fresh samples, since the
responses with more steps are the ones that branch). A tree saves at most what its branches share:
with mean branch position f (fraction of the response) the ratio is about (1 + N T (1 - f)) / (1 + N T)
per expanded response, and 1 for a response without a branch point; later rounds branch paths that
already share a prefix, so each adds leaves at a lower cost. Printed beside the ratios: branch points
per tree and their mean position f (fraction of the parent path). At T = 2, 0.6 needs f >= 0.5 with
two points per tree and f >= 0.6 with one.

With ``--model search`` (issue 29): the search model's plain-format Countdown search traces (one line
per move tried, so many more steps than the tiny model's), and beside the token ratio the
valid-group ratio of each branching strategy (AttnRL Fig. 4): the fraction of trees whose leaves'
rewards (exact Countdown check) are not all equal, i.e. groups that carry a learning signal; and,
finer, the mixed-branch ratio: the fraction of branch points whose outcomes differ (the parent path's
reward and its T continuations' are not all equal): a branch at a step that decides the search splits
right and wrong answers there (AttnRL's claim for high-FCI steps), a branch at a step that does not
reproduces the parent's outcome. The valid-group ratio saturates at 1.00 once trees have ~15 leaves and
accuracy is near 0.3 (measured 2026-11-24); the mixed-branch ratio does not.

Usage: ``python bench/tree.py [--model tiny|search] [--prompts 4] [--delta 2] [--min-distance 8]
[--iterations 1,2,3] [--seed 0]`` (``--seed`` moves every sampling seed, same prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.wire import RolloutRequest, SamplingParams  # noqa: E402
from loom.runtime import configure_process  # noqa: E402

# L, strategy, token ratio, valid groups (tree, independent), branch points per tree, position, mixed
Row = tuple[int, str, float, float, float, float, float, float]


def computed(engine) -> int:
    return engine.stats.prefill_tokens + engine.stats.decode_tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--delta", type=int, default=2, help="FCI delta (the tiny model's traces have few steps)")
    p.add_argument("--min-distance", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--continuations", type=int, default=2, help="T")
    p.add_argument(
        "--iterations", default="1,2,3", help="L values, each measured: expansion rounds (TreeRL's EPTree)"
    )
    p.add_argument("--model", choices=("tiny", "search"), default="tiny")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seeds (same prompts); 0: the recorded runs'")
    p.add_argument("--record", action="store_true", help="write docs/benchmarks/tree-<model>.md and .png")
    a = p.parse_args()
    configure_process()
    from loom.answers import last_boxed
    from loom.contracts.modes import parse_mode_params
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.modes.tree import tree
    from zoo.registry import resolve_model_path
    from zoo.search import search_problems
    from zoo.tiny import plain_prompt, reflect_prompt, tiny_problems

    engine = TorchEngine(resolve_model_path(a.model), cache_entries=64)
    tok = engine.tokenizer
    if a.model == "tiny":  # the distribution the tiny model was trained on
        problems, build, what = (
            tiny_problems("arith", a.prompts, seed=7),
            reflect_prompt,
            "reflect-format arithmetic",
        )
    else:
        problems, build, what = (
            search_problems("countdown", a.prompts, seed=7),
            plain_prompt,
            "plain Countdown search",
        )
    print(
        f"{a.model} model, {a.prompts} {what} prompts, "
        f"M'=6 N=2 T={a.continuations}, max_tokens={a.max_tokens}, temperature={a.temperature}"
    )
    rows: list[Row] = []
    for iterations in [int(x) for x in a.iterations.split(",")]:
        for strategy in ("attention", "entropy", "random"):
            tree_c = indep_c = leaves = gen = indep_gen = own = 0
            points: set[tuple[str, int]] = set()  # distinct (parent path, branch point)
            fractions: list[float] = []  # each point's position as a fraction of its parent path
            trees = valid = indep_valid = 0
            mixed: list[bool] = []  # per branch point: do the parent's and continuations' outcomes differ
            for k, prob in enumerate(problems):
                req = RolloutRequest(
                    mode="tree",
                    prompt=build(prob),
                    sampling=SamplingParams(
                        max_tokens=a.max_tokens, seed=100 + k + 1000 * a.seed, temperature=a.temperature
                    ),
                    mode_params={
                        "strategy": strategy,
                        "delta": a.delta,
                        "min_distance": a.min_distance,
                        "continuations": a.continuations,
                        "iterations": iterations,
                    },
                )
                ids = tok.encode(req.prompt, add_special_tokens=False)
                asyncio.run(engine.reset_cache())
                before = computed(engine)
                g = asyncio.run(tree(req, ids, f"t{k}", engine, tok, parse_mode_params(req)))
                tree_c += computed(engine) - before
                n = len(g.trajectories)
                by_id = {t.id: t for t in g.trajectories}
                trees += sum(t.parent_id is None for t in g.trajectories)
                for t in g.trajectories:
                    if t.parent_id is not None and (t.parent_id, t.meta["branch_point"]) not in points:
                        points.add((t.parent_id, t.meta["branch_point"]))
                        fractions.append(t.meta["branch_point"] / len(by_id[t.parent_id].completion_ids))
                leaves += n
                reward = {t.id: prob.verify(last_boxed(tok.decode(t.completion_ids))) for t in g.trajectories}
                valid += len(set(reward.values())) > 1  # a group with a learning signal (AttnRL Fig. 4)
                mixed.extend(branch_outcomes_differ(g.trajectories, reward))
                gen += g.meta["tokens_generated"]
                own += g.meta["tokens_independent"]  # the tree's own leaves, each sampled from scratch
                asyncio.run(engine.reset_cache())
                before = computed(engine)
                outs = asyncio.run(
                    engine.generate(
                        ids, req.sampling.model_copy(update={"n": n, "seed": 900 + k + 1000 * a.seed})
                    )
                )
                indep_c += computed(engine) - before
                indep_gen += sum(len(c.token_ids) for c in outs)
                indep_valid += len({prob.verify(last_boxed(tok.decode(c.token_ids))) for c in outs}) > 1
            print(
                f"L={iterations} {strategy:9s} leaves={leaves:3d}  computed tokens: tree={tree_c:6d} "
                f"independent={indep_c:6d} ratio={tree_c / indep_c:.3f} (target <= 0.6) | generated: "
                f"tree={gen} independent={indep_gen} | vs the tree's own leaves from scratch: {own} tokens, "
                f"ratio={gen / own:.3f} | branch points per tree {len(points) / trees:.2f} at "
                f"{statistics.fmean(fractions) if fractions else 0.0:.2f} of the parent path (mean) | "
                f"valid groups {valid}/{len(problems)} = {valid / len(problems):.2f} "
                f"(independent sampling: {indep_valid / len(problems):.2f}) | mixed branch points "
                f"{sum(mixed)}/{len(mixed)} = {sum(mixed) / max(1, len(mixed)):.2f}"
            )
            frac = statistics.fmean(fractions) if fractions else 0.0
            rows.append(
                (
                    iterations,
                    strategy,
                    tree_c / indep_c,
                    valid / len(problems),
                    indep_valid / len(problems),
                    len(points) / trees,
                    frac,
                    sum(mixed) / max(1, len(mixed)),
                )
            )
    if a.record:
        record(a, what, len(problems), rows)


def branch_outcomes_differ(trajectories, reward: dict[str, bool]) -> list[bool]:  # type: ignore[no-untyped-def]
    """Per branch point (parent path, token index): whether the parent path's reward and the rewards of
    the continuations sampled there are not all equal."""
    at: dict[tuple[str, int], set[bool]] = {}
    for t in trajectories:
        if t.parent_id is not None:
            at.setdefault((t.parent_id, t.meta["branch_point"]), {reward[t.parent_id]}).add(reward[t.id])
    return [len(outcomes) > 1 for outcomes in at.values()]


def record(a, what: str, n: int, rows: list[Row]) -> None:  # type: ignore[no-untyped-def]
    from bench.report import write

    table = [
        "| L | strategy | computed tokens tree / independent (target <= 0.6) | valid groups, tree "
        "| valid groups, independent | branch points per tree | mean branch position | mixed branch points |",
        "|---|---|---|---|---|---|---|---|",
        *(f"| {r[0]} | {r[1]} | {r[2]:.3f} | " + " | ".join(f"{x:.2f}" for x in r[3:]) + " |" for r in rows),
    ]

    def plot(fig) -> None:  # type: ignore[no-untyped-def]

        ax = fig.subplots()
        strategies = ("attention", "entropy", "random")
        levels = sorted({r[0] for r in rows})
        width = 0.8 / len(strategies)
        for k, strategy in enumerate(strategies):
            got = {r[0]: r for r in rows if r[1] == strategy}
            xs = [i + k * width for i in range(len(levels))]
            ax.bar(xs, [got[lv][2] for lv in levels], width, label=f"{strategy}: token ratio")
            ax.plot(
                xs, [got[lv][3] for lv in levels], ("k^", "kv", "kx")[k], label=f"{strategy}: valid groups"
            )
            ax.plot(
                xs, [got[lv][7] for lv in levels], ("r^", "rv", "rx")[k], label=f"{strategy}: mixed branches"
            )
        ax.axhline(0.6, color="grey", linestyle="--", linewidth=1)
        ax.set_xticks([i + width for i in range(len(levels))], [f"L={lv}" for lv in levels])
        ax.set_ylabel("token ratio (bars), fractions (marks)")
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))

    path = write(
        f"tree-{a.model}",
        f"Tree mode vs independent sampling ({a.model} model, {n} {what} prompts)",
        table,
        notes=[
            f"Settings: M'=6 N=2 T={a.continuations}, delta {a.delta}, min distance {a.min_distance}, "
            f"max_tokens {a.max_tokens}, temperature {a.temperature}. Valid group: a tree (or the same "
            "number of independent samples) whose leaves' exact rewards are not all equal (AttnRL Fig. 4). "
            "Mixed branch point: the parent path's reward and those of the continuations sampled at that "
            "point are not all equal."
        ],
        plot=plot,
        figsize=(9.0, 4.0),
    )
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
