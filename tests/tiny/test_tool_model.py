"""The built-in tool model (zoo/tiny/tool.py, docs/models.md "The tool model"): its traces are the very
sequences agent mode builds, and on the real torch engine agent mode's greedy episodes call the
calculator and answer held-out problems right, far more often than without it. Nothing is mocked: the
shipped checkpoint, Loom's torch engine, the rollout service's agent mode and its tools."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from bench.tool_model import agent_request, episodes
from launch.demo import mode_model, parse_args, run_request
from loom.contracts.modes import parse_mode_params
from loom.runtime import configure_process
from rollout_svc.engines.base import Completion
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.modes.agent import Agent
from zoo.recipe import encode
from zoo.registry import resolve_model_path
from zoo.tiny import tool
from zoo.tiny.tasks import HELDOUT_SEED


@pytest.fixture(scope="module")
def tool_engine() -> Any:
    configure_process()
    from rollout_svc.engines.torch import TorchEngine

    return TorchEngine(resolve_model_path("tool"), cache_entries=64, device="cpu")


@pytest.mark.parametrize("kind", list(tool.KINDS))
def test_a_trace_is_the_sequence_agent_mode_builds(tool_engine: Any, kind: str) -> None:
    """Agent mode, its turns forced to a trace's policy text (the recipe's own encoding of each piece),
    builds exactly the trace's ids: the same observations from the same tools, the trained tokens
    the policy's (loss mask 1), the observations masked."""
    problem = tool.tool_problems(3, 0, "train")[2]  # a multiplication: 19*434
    pieces = tool.tool_trace(problem, kind, random.Random(1))
    tok = tool_engine.tokenizer
    (ids, labels) = encode([pieces], tok, 512)[0]
    prompt_ids = tok.encode(pieces[0].text, add_special_tokens=False)
    enabled = tool.NO_TOOL if kind == "fallback" else tool.TOOLS_ON
    request = agent_request(problem, enabled)
    agent = Agent(request, tool_engine, tok, parse_mode_params(request))  # type: ignore[arg-type]
    # the policy's turns: the trained pieces between the observations, each piece encoded alone
    turn_ids: list[list[int]] = []
    cur: list[int] = []
    for piece in pieces[1:]:
        if piece.train:
            cur += tok.encode(piece.text, add_special_tokens=False)
        else:
            turn_ids.append(cur)
            cur = []
    turn_ids.append([*cur, tok.eos_token_id])

    async def forced(history: list[int], max_tokens: int, k: int) -> Completion:
        toks = turn_ids[k]
        called = toks[-len(agent.close_ids) :] == agent.close_ids
        lp = teacher_forced_logprobs(tool_engine.model, history + toks, len(history))
        return Completion(toks, lp, "stop", agent.syntax.call_close if called else None)

    ep = asyncio.run(agent.episode(prompt_ids, forced))
    assert prompt_ids + ep.ids == ids
    assert ep.mask == [int(label != -100) for label in labels[len(prompt_ids) :]]
    assert ep.tool_calls == {"call": 1, "head": 0, "retry": 2, "fallback": 1}[kind]


def test_agent_mode_on_the_tool_model_calls_the_calculator_and_answers(tool_engine: Any) -> None:
    """Greedy agent episodes on 16 held-out problems: with the calculator most call it and are
    right; without it (the call answered ``unknown tool``) the column steps are mostly wrong."""
    problems = tool.tool_problems(16, HELDOUT_SEED, "test")
    with_tool = asyncio.run(episodes(tool_engine, problems, tool.TOOLS_ON))
    without = asyncio.run(episodes(tool_engine, problems, tool.NO_TOOL))
    assert sum(r["calls"] > 0 for r in with_tool) >= 12
    assert sum(r["correct"] for r in with_tool) >= 13
    assert any("<result>" in r["text"] and r["correct"] for r in with_tool)
    assert sum(r["correct"] for r in without) <= sum(r["correct"] for r in with_tool) - 6
    assert all("unknown tool 'calculator'" in r["text"] for r in without if r["calls"] > 0)


def test_the_agent_demo_runs_the_tool_model_with_the_calculator() -> None:
    args = parse_args(["--mode", "agent"])
    body = run_request(args)
    assert body["mode"] == "agent" and mode_model("agent") == "tool"
    assert body["mode_params"] == {"parser": "function", "tools": ["calculator"], "max_turns": tool.MAX_TURNS}
    assert body["dataset"]["knobs"]["ops"] == ["+", "-", "*"]
    with pytest.raises(SystemExit):
        parse_args(["--mode", "agent", "--task", "countdown"])
