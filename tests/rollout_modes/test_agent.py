"""agent mode: tool-call parsing, the safe calculator, and episodes on Loom's tiny model in the real
torch engine with its real tokenizer. The first turns are forced (their ids written by the test,
their log-probs the model's own teacher-forced ones), so the policy calls tools deterministically;
the turns after are the engine's. Nothing is mocked."""

from __future__ import annotations

import threading
from asyncio import run
from typing import Any

import pytest

from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.train import Learner
from loom.clients.rollouts import env_mask
from loom.contracts.modes import parse_mode_params
from loom.contracts.settings import Settings
from loom.contracts.wire import (
    Group,
    RewardResult,
    RolloutRequest,
    SamplingParams,
    TrainBatch,
    TrajectoryReward,
)
from loom.formats import ends_with
from rollout_svc.engines.base import Completion
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.modes import ModeError
from rollout_svc.modes import agent as agent_mod
from rollout_svc.modes import run as run_mode
from rollout_svc.modes.agent import MALFORMED, Agent, ToolError, calculate, parse_call, trajectory
from zoo.tiny import CHECKPOINT_DIR

PROMPT = "Q: what is 2+3? use the calculator.\n"
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def _request(**mode_params: Any) -> RolloutRequest:
    return RolloutRequest(
        mode="agent",
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=96, temperature=0.0, n=1),
        mode_params=mode_params,
    )


def _agent(engine: Any, **mode_params: Any) -> Agent:
    request = _request(**mode_params)
    return Agent(request, engine, engine.tokenizer, parse_mode_params(request))  # type: ignore[arg-type]


def _forced(agent: Agent, engine: Any, script: list[str | list[int]]) -> Any:
    """A policy whose first turns are ``script`` (text, or ids as written), scored by the model's
    own teacher-forced pass; later turns are the engine's."""
    real = agent.policy(0)

    async def turn(ids: list[int], max_tokens: int, k: int) -> Completion:
        if k >= len(script):
            return await real(ids, max_tokens, k)
        step = script[k]
        whole = agent.encode(step) if isinstance(step, str) else list(step)
        toks = whole[:max_tokens]
        lp = teacher_forced_logprobs(engine.model, ids + toks, len(ids))
        if len(toks) < len(whole):
            return Completion(toks, lp, "length")
        called = ends_with(toks, agent.close_ids)
        return Completion(toks, lp, "stop", agent.syntax.call_close if called else None)

    return turn


def _episode(engine: Any, script: list[str | list[int]], **mode_params: Any) -> tuple[Any, list[int], Agent]:
    agent = _agent(engine, **mode_params)
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    return run(agent.episode(prompt_ids, _forced(agent, engine, script))), prompt_ids, agent


# ------------------------------------------------------------------------------------------------
# parsing and the calculator (pure)


def test_parses_hermes_and_function_calls():
    assert parse_call("think " + CALC, "hermes") == agent_mod.ToolCall("calculator", {"expression": "2+3"})
    args_as_text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    assert parse_call(args_as_text, "hermes") == agent_mod.ToolCall("calculator", {"expression": "1"})
    assert parse_call("<call>calculator(2+3)</call>", "function") == agent_mod.ToolCall(
        "calculator", {"input": "2+3"}
    )
    assert parse_call('<call>countdown_check({"target": 3})</call>', "function") == agent_mod.ToolCall(
        "countdown_check", {"target": 3}
    )
    for bad in ["<tool_call>{not json}</tool_call>", "<tool_call>[1]</tool_call>", "no open </tool_call>"]:
        assert parse_call(bad, "hermes") is None
    assert parse_call("<call>2+3</call>", "function") is None


@pytest.mark.parametrize(
    ("expr", "want"), [("2+3", "5"), ("7/2", "3.5"), ("2**10", "1024"), ("-(3*4)%5", "3"), ("0.1+0.2", "0.3")]
)
def test_calculator_is_exact(expr, want):
    assert calculate(expr) == want


@pytest.mark.parametrize(
    "expr", ["__import__('os').system('true')", "2**10**10", "9**99**9", "1/0", "x+1", "(" * 300, "[1]*9"]
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr):
    with pytest.raises(ToolError):
        calculate(expr)


def test_agent_params_are_validated():
    for bad in [{"tools": ["shell"]}, {"parser": "xml"}, {"max_turns": 0}, {"tool_timeout_s": 0}]:
        with pytest.raises(ModeError):
            parse_mode_params(_request(**bad))


# ------------------------------------------------------------------------------------------------
# episodes on the tiny model


def test_an_episode_is_the_exact_concatenation_and_its_logprobs_are_teacher_forced(tiny_engine):
    ep, prompt_ids, agent = _episode(tiny_engine, [CALC], max_turns=3)
    tok = tiny_engine.tokenizer
    turns = [s for s in ep.segments if s.kind == "turn"]
    (obs,) = [s for s in ep.segments if s.kind == "observation"]
    assert turns[0].meta == {
        "tool_call": {"name": "calculator", "arguments": {"expression": "2+3"}},
        "status": "ok",
    }
    assert len(turns) == 2 and ep.turns == 2 and ep.tool_calls == 1  # the forced call, then the engine's turn
    # completion_ids = policy turn 0 + observation + policy turn 1, exactly, in order
    want_obs = tok.encode("\n<tool_response>\n5\n</tool_response>\n", add_special_tokens=False)
    assert ep.ids[obs.start : obs.end] == want_obs
    assert ep.ids == ep.ids[: turns[0].end] + want_obs + ep.ids[turns[1].start :]
    assert [(s.start, s.end) for s in ep.segments] == [
        (0, obs.start),
        (obs.start, obs.end),
        (obs.end, len(ep.ids)),
    ]
    assert ep.mask == [0 if obs.start <= i < obs.end else 1 for i in range(len(ep.ids))]
    assert ep.logprobs[obs.start : obs.end] == [0.0] * len(want_obs)
    # the engine's turn was decoded after the observation: its behaviour log-probs are those of a
    # teacher-forced pass of the same weights over the whole multi-turn sequence
    want = teacher_forced_logprobs(tiny_engine.model, prompt_ids + ep.ids, len(prompt_ids))
    trained = [i for i, m in enumerate(ep.mask) if m]
    assert [ep.logprobs[i] for i in trained] == pytest.approx([want[i] for i in trained], abs=1e-4)
    assert ep.stop in {"no_tool_call", "max_turn_tokens"}
    t = trajectory("g", 0, prompt_ids, ep, tiny_engine, 0.0)
    assert t.stop_reason == ep.stop and t.loss_mask == ep.mask


def test_history_is_never_retokenized(tiny_engine):
    tok = tiny_engine.tokenizer
    split = [tok.convert_tokens_to_ids(c) for c in ("t", "h", "e")]  # "the" as the policy sampled it
    assert tok.encode("the", add_special_tokens=False) != split  # the canonical encoding merges it
    ep, prompt_ids, agent = _episode(tiny_engine, [CALC, split], max_turns=2)
    assert ep.stop == "no_tool_call" and ep.ids[-3:] == split
    full = prompt_ids + ep.ids
    assert tok.encode(tok.decode(full), add_special_tokens=False) != full  # a re-encode would change the ids
    obs = next(s for s in ep.segments if s.kind == "observation")
    assert ep.ids == agent.encode(CALC) + ep.ids[obs.start : obs.end] + split


@pytest.mark.parametrize(
    ("call", "status", "needle"),
    [
        ("<call>{oops}</call>", "malformed", MALFORMED),
        ("<call>shell(1)</call>", "unknown_tool", "unknown tool 'shell'"),
        ("<call>calculator(raise)</call>", "tool_error", "RuntimeError: boom"),
        ("<call>calculator(hang)</call>", "timeout", "timed out after 0.2 s"),
        ("<call>calculator(long)</call>", "ok", "... [truncated"),
        ("<call>calculator(1/0)</call>", "tool_error", "division by zero"),
        ('<call>countdown_check({"input": "3*4", "numbers": [3, 4], "target": 12})</call>', "ok", "correct"),
        ("<call>calculator(2*3)</call>", "ok", "<result>6</result>"),
    ],
)
def test_bad_tool_use_is_a_typed_observation_and_the_episode_goes_on(
    tiny_engine, monkeypatch, call, status, needle
):
    release = threading.Event()

    def flaky(args: dict[str, Any]) -> str:
        if args["input"] == "raise":
            raise RuntimeError("boom")
        if args["input"] == "hang":
            release.wait(10)
            return "late"
        if args["input"] == "long":
            return "9 " * 400
        return calculate(args["input"])

    monkeypatch.setitem(agent_mod.TOOLS, "calculator", flaky)
    try:
        ep, _, _ = _episode(
            tiny_engine, [call, "done"], parser="function", tool_timeout_s=0.2, max_observation_tokens=64
        )
    finally:
        release.set()
    (turn, obs, last) = ep.segments
    text = tiny_engine.tokenizer.decode(ep.ids[obs.start : obs.end])
    assert obs.kind == "observation" and obs.meta["status"] == status and needle in text
    assert turn.meta["status"] == status and obs.meta["truncated"] == ("long" in call)
    assert obs.end - obs.start <= 64 + 48  # the capped text, its mark and the wrapper
    # the episode goes on: the next turn is the policy's, and it ends the episode
    assert last.kind == "turn" and ep.stop == "no_tool_call" and ep.finish == "stop" and ep.turns == 2


def test_budgets_end_the_episode_with_their_reason(tiny_engine):
    ep, _, _ = _episode(tiny_engine, [CALC] * 3, max_turns=2)
    assert ep.stop == "max_turns" and ep.turns == 2 and ep.tool_calls == 1
    n = len(_agent(tiny_engine).encode(CALC))
    ep, _, _ = _episode(tiny_engine, [CALC] * 3, max_total_tokens=n + 5)
    assert ep.stop == "max_total_tokens" and len(ep.ids) <= n + 5
    ep, _, _ = _episode(tiny_engine, [CALC] * 3, deadline_s=1e-9)
    assert ep.stop == "deadline" and ep.finish == "abort" and ep.ids == []


def test_the_mode_runs_through_the_dispatch_and_the_learner_masks_observations(tiny_engine):
    request = _request(max_turns=2)
    prompt_ids = tiny_engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = parse_mode_params(request)
    group = run(
        run_mode(request, prompt_ids, "g", tiny_engine, lambda: tiny_engine.tokenizer, params, Settings())
    )
    assert group.mode == "agent" and len(group.trajectories) == 1
    # a learner batch of agent samples: two trajectories, one with a tool observation
    ep, _, _ = _episode(tiny_engine, [CALC], max_turns=2)
    with_tool = trajectory("h", 1, prompt_ids, ep, tiny_engine, 0.0)
    g = Group(
        id="h",
        mode="agent",
        trajectories=[group.trajectories[0].model_copy(update={"group_id": "h", "id": "h/0"}), with_tool],
    )
    rewards = [
        RewardResult(
            group_id="h",
            rewards=[
                TrajectoryReward(trajectory_id="h/0", total=0.0),
                TrajectoryReward(trajectory_id="h/1", total=1.0),
            ],
        )
    ]
    assigned = assign_batch(TrainBatch(step=0, groups=[g], rewards=rewards))
    sample = next(s for s in assigned.samples if s.trajectory.id == "h/1")
    obs = next(s for s in ep.segments if s.kind == "observation")
    assert sample.mask == ep.mask and sum(sample.mask[obs.start : obs.end]) == 0
    assert all(a > 0 for a, m in zip(sample.adv, sample.mask, strict=True) if m)
    assert env_mask(with_tool) == ep.mask  # what a trainer adapter reads: 0 on observation tokens


def test_the_learner_trains_on_agent_samples(tiny_engine, tmp_path):
    prompt_ids = tiny_engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    trajs = []
    for r, script in enumerate([[CALC], ["no tool"]]):
        ep, _, _ = _episode(tiny_engine, [*script, "done"], max_turns=3)
        trajs.append(trajectory("h", r, prompt_ids, ep, tiny_engine, 0.0))
    group = Group(id="h", mode="agent", trajectories=trajs)
    rewards = [
        RewardResult(
            group_id="h",
            rewards=[TrajectoryReward(trajectory_id=t.id, total=float(r)) for r, t in enumerate(trajs)],
        )
    ]
    learner = Learner(LearnerSettings(model=CHECKPOINT_DIR, store=tmp_path / "store", token_budget=512))
    result = learner.train_step(TrainBatch(step=0, groups=[group], rewards=rewards))
    assert result.policy_version == 1 and result.metrics["samples"] == 2
    assert result.n_tokens == sum(sum(t.loss_mask or []) for t in trajs)  # observations not counted
