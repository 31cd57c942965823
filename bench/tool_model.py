"""Held-out greedy accuracy of the built-in tool model through agent mode on the torch engine, with
the calculator enabled and without it (docs/models.md, "The tool model").

Each held-out problem is one agent-mode request (``parser=function``, greedy, ``n=1``) through the
rollout service's mode dispatch on Loom's torch engine; the answer is the completion's last boxed
value, checked exactly. Reported per tool set: accuracy, episodes that called a tool, the calls' mean,
why the episodes stopped.

    loom bench tool_model [--problems 100] [--model tool]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from typing import Any

from loom.answers import last_boxed
from loom.contracts.modes import parse_mode_params
from loom.contracts.settings import Settings
from loom.contracts.wire import RolloutRequest, SamplingParams
from loom.runtime import configure_process
from rollout_svc.modes import run as run_mode
from zoo.registry import resolve_model_path
from zoo.tiny import tool
from zoo.tiny.tasks import HELDOUT_SEED, Problem
from zoo.tiny.traces import plain_prompt


def agent_request(problem: Problem, tools: list[str], n: int = 1, temperature: float = 0.0) -> RolloutRequest:
    """The agent-mode request of one problem (the tool model's parser, turns and turn budget)."""
    return RolloutRequest(
        mode="agent",
        prompt=plain_prompt(problem),
        sampling=SamplingParams(max_tokens=tool.TURN_TOKENS, temperature=temperature, n=n, seed=0),
        mode_params={"parser": tool.PARSER, "tools": tools, "max_turns": tool.MAX_TURNS},
    )


async def episodes(engine: Any, problems: list[Problem], tools: list[str]) -> list[dict[str, Any]]:
    """One greedy agent episode per problem, all in flight at once (the engine batches them)."""
    tok = engine.tokenizer

    async def one(i: int, p: Problem) -> dict[str, Any]:
        req = agent_request(p, tools)
        prompt_ids = tok.encode(req.prompt, add_special_tokens=False)
        group = await run_mode(
            req, prompt_ids, f"g{i}", engine, lambda: tok, parse_mode_params(req), Settings()
        )
        t = group.trajectories[0]
        text = tok.decode(t.completion_ids)
        answer = last_boxed(text) if "</think>" in text else None
        return {
            "correct": p.verify(answer),
            "calls": t.meta["tool_calls"],
            "stop": t.stop_reason,
            "text": text,
        }

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(problems))))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(rows)
    return {
        "accuracy": round(sum(r["correct"] for r in rows) / n, 4),
        "correct": sum(r["correct"] for r in rows),
        "total": n,
        "episodes_with_call": sum(r["calls"] > 0 for r in rows),
        "calls_mean": round(sum(r["calls"] for r in rows) / n, 3),
        "stops": dict(Counter(r["stop"] for r in rows)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--problems", type=int, default=100)
    p.add_argument("--model", default="tool")
    args = p.parse_args()
    configure_process()
    from rollout_svc.engines.torch import TorchEngine

    engine = TorchEngine(resolve_model_path(args.model), cache_entries=64, device="cpu")
    problems = tool.tool_problems(args.problems, HELDOUT_SEED, "test")
    out: dict[str, Any] = {}
    for name, tools in (("tool", tool.TOOLS_ON), ("no_tool", tool.NO_TOOL)):
        t0 = time.perf_counter()
        rows = asyncio.run(episodes(engine, problems, tools))
        out[name] = {
            **summary(rows),
            "seconds": round(time.perf_counter() - t0, 1),
            "sample": rows[0]["text"],
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
