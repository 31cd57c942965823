"""Tree search over turns: agent_tree vs independent agent episodes (docs/algorithms.md §2.6).

The search model on its plain-format Countdown prompts (zoo/search), each episode multi-turn with the
inline calculator (agent's ``inline`` parser: a turn ends at ``=``, the calculator's exact result is
the observation, loss-masked). Per seed and prompt, per branching strategy (``entropy``, ``turn``,
``attention``: the FCI of the episodes' reasoning steps from the torch engine's own scorer):

- **tree**: agent_tree with M' = ``--initial``, N = 2, T = 2, L = ``--iterations``;
- **independent**: agent mode, n = as many episodes as the largest tree has leaves, same prompt.

Printed per strategy and seed, summed over the prompts:

- **token ratio at equal leaves**: the policy tokens the tree generated (its children's own tokens
  only; the copied prefixes and the observations are not generated) over the policy tokens of as
  many independent episodes as the tree has leaves (the first ones drawn). bench/tree.py's ratio, for
  episodes; beside it the tool calls the tree ran over the independent episodes' calls;
- **accuracy at equal tokens**: the tree's mean leaf accuracy and pass rate (a prompt with a correct
  leaf) against the independent episodes that fit in the tree's generated tokens (the first k whose
  policy tokens sum to at most the tree's): the same decode budget, more leaves for the tree.

The mean and standard deviation over the ``--seeds`` (default three) close each strategy's rows.

    python bench/agent_tree.py [--prompts 6] [--seeds 0,1,2] [--initial 2] [--iterations 2]
                               [--max-tokens 160] [--temperature 1.0] [--strategies entropy,turn,attention]
                               [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.wire import RolloutRequest, SamplingParams  # noqa: E402
from loom.runtime import configure_process  # noqa: E402


def policy_tokens(t: Any, start: int = 0) -> int:
    return sum(max(0, s.end - max(s.start, start)) for s in t.segments if s.kind == "turn")


def one_seed(
    engine: Any, problems: list[Any], strategy: str, seed: int, a: argparse.Namespace
) -> dict[str, float]:
    """One strategy at one seed, summed over the prompts."""
    from loom.answers import last_boxed
    from loom.contracts.modes import parse_mode_params
    from rollout_svc.modes.agent import agent
    from rollout_svc.modes.agent_tree import agent_tree
    from zoo.tiny import plain_prompt

    tok = engine.tokenizer
    out = dict.fromkeys(("tree_tok", "eq_tok", "tree_calls", "eq_calls", "leaves", "k"), 0.0)
    out |= dict.fromkeys(("tree_acc", "tok_acc", "tree_pass", "tok_pass"), 0.0)
    for i, prob in enumerate(problems):
        common = {"parser": "inline", "max_turns": 48}
        sampling = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=1000 * seed + i)
        tree_mp = common | {"strategy": strategy, "initial": a.initial, "iterations": a.iterations}
        req = RolloutRequest(
            mode="agent_tree", prompt=plain_prompt(prob), sampling=sampling, mode_params=tree_mp
        )
        ids = tok.encode(req.prompt, add_special_tokens=False)
        g = asyncio.run(agent_tree(req, ids, f"t{i}", engine, tok, parse_mode_params(req)))
        n = len(g.trajectories)
        ind_req = RolloutRequest(
            mode="agent", prompt=req.prompt, sampling=sampling.model_copy(update={"n": n}), mode_params=common
        )
        ind = asyncio.run(agent(ind_req, ids, f"i{i}", engine, tok, parse_mode_params(ind_req))).trajectories

        def ok(t: Any, prob: Any = prob) -> bool:
            return bool(prob.verify(last_boxed(tok.decode(t.completion_ids))))

        gen = g.meta["tokens_generated"]
        k, spent = 0, 0
        while k < n and spent + policy_tokens(ind[k]) <= gen:  # the episodes that fit in the tree's tokens
            spent += policy_tokens(ind[k])
            k += 1
        tree_ok, ind_ok = [ok(t) for t in g.trajectories], [ok(t) for t in ind[: max(k, 1)]]
        out["tree_tok"] += gen
        out["eq_tok"] += sum(policy_tokens(t) for t in ind)
        out["tree_calls"] += g.meta["tool_calls_run"]
        out["eq_calls"] += sum(t.meta["tool_calls"] for t in ind)
        out["leaves"] += n
        out["k"] += k
        out["tree_acc"] += sum(tree_ok) / n / len(problems)
        out["tok_acc"] += sum(ind_ok) / len(ind_ok) / len(problems)
        out["tree_pass"] += any(tree_ok) / len(problems)
        out["tok_pass"] += any(ind_ok) / len(problems)
    return out


def row(name: str, r: dict[str, float]) -> str:
    cells = [f"{r['leaves']:.0f}", f"{r['tree_tok'] / r['eq_tok']:.3f}"]
    cells += [f"{r['tree_calls'] / max(r['eq_calls'], 1):.3f}"]
    cells += [f"{r['k']:.0f}", f"{r['tree_acc']:.3f}", f"{r['tok_acc']:.3f}"]
    cells += [f"{r['tree_pass']:.2f}", f"{r['tok_pass']:.2f}"]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--initial", type=int, default=2)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--model", default="search")
    p.add_argument("--strategies", default="entropy,turn,attention")
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    a = p.parse_args()
    configure_process()
    from rollout_svc.engines.torch import TorchEngine
    from zoo.registry import resolve_model_path
    from zoo.search import search_problems

    engine = TorchEngine(resolve_model_path(a.model), cache_entries=64)
    problems = search_problems("countdown", a.prompts, seed=7)
    seeds = [int(s) for s in a.seeds.split(",")]
    head = (
        f"{a.model} model, {a.prompts} plain Countdown prompts, inline calculator, M'={a.initial} N=2 T=2 "
        f"L={a.iterations}, max_tokens={a.max_tokens} per turn, temperature={a.temperature}, "
        f"seeds {seeds}\n\n"
        "| strategy / seed | leaves | tokens tree/indep (equal leaves) | tool calls tree/indep "
        "| indep episodes at equal tokens | tree leaf acc | indep acc (equal tokens) | tree pass "
        "| indep pass |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines, t0 = [head], time.perf_counter()
    for strategy in a.strategies.split(","):
        per = [one_seed(engine, problems, strategy, s, a) for s in seeds]
        lines += [row(f"{strategy} / {s}", r) for s, r in zip(seeds, per, strict=True)]
        ratios = [r["tree_tok"] / r["eq_tok"] for r in per]
        gain = [r["tree_acc"] - r["tok_acc"] for r in per]
        sd = (statistics.stdev(ratios), statistics.stdev(gain)) if len(per) > 1 else (0.0, 0.0)
        lines.append(
            f"| {strategy}: mean ± sd | | {statistics.mean(ratios):.3f} ± {sd[0]:.3f} | | | "
            f"tree − indep acc {statistics.mean(gain):+.3f} ± {sd[1]:.3f} | | | |"
        )
        print("\n".join(lines[-len(per) - 1 :]), flush=True)
    lines.append(f"\n{time.perf_counter() - t0:.0f} s in all")
    print(lines[0])
    print("\n".join(lines[1:]))
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
