"""agent (docs/algorithms.md §2.5): multi-turn tool use, token-in/token-out.

An episode alternates policy turns and tool observations on one running id sequence. A turn decodes
until it closes a tool call (the parser's close tag, matched on its canonical ids like spawn's close
marker: ``loom.formats.marker_ids``) or ends; the call is parsed from the turn's own text, the tool runs
in a worker thread under a timeout, and its output, wrapped in the parser's fixed response tags, is
encoded alone and appended. The history is never re-tokenized: ``completion_ids`` is exactly the
concatenation of the policy's tokens and the observations' tokens, so the learner scores the very
sequence the policy sampled (a decode and re-encode of the history may split it otherwise).

Observation tokens have loss mask 0 and behaviour log-prob 0.0 (spawn's join blocks likewise); a
``turn`` segment per policy turn carries its parsed call and status, an ``observation`` segment per
tool response its tool and status. Why the episode ended is the trajectory's ``stop_reason``:
``no_tool_call`` (the turn ended without one), ``max_turns``, ``max_total_tokens`` (policy and
observation tokens together), ``max_turn_tokens`` (a turn cut by ``sampling.max_tokens``),
``context`` (the model's context is full) or ``deadline`` (the episode's wall time, checked between
steps; a tool's timeout is bounded by what is left of it).

With ``environment`` (docs/environments.md) every turn is instead a step of that environment on the
env tier (``loom.clients.env``): its observation is appended the same way, its per-turn reward kept
in the turn's meta and ``turn_rewards``; ``env_done`` ends the episode when it says done, ``env_lost``
when its worker is gone. A chat environment's system prompt and tool schemas (its reset's ``chat``)
are rendered with the question, the user turn, through the policy's chat template (env_chat.py); that
prompt is the one the episode is conditioned on and the trajectory's ``prompt_ids``.

Bad tool use is an observation, never an exception: a malformed call (``error: malformed tool
call``), an unknown or disabled tool, a tool that raises, one that runs past ``tool_timeout_s`` (its
thread is left to finish; the episode goes on) and an output over ``max_observation_tokens``
(truncated and marked).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from loom.clients.env import EnvSession, get_env_client
from loom.contracts.envs import MAX_ACTION_CHARS, EnvTask
from loom.contracts.modes import AgentParams
from loom.contracts.wire import (
    FinishReason,
    Group,
    RolloutRequest,
    SamplingParams,
    Trajectory,
)
from loom.formats import MarkerError, encode_with_markers, ends_with, marker_ids

# the tool-call formats and the built-in tools are pure (loom/tools.py): the tool model's traces
# (zoo/tiny/tool.py) render their observations with the same functions
from loom.tools import (  # noqa: F401  (calculate: agent mode's names as they were, re-exported)
    MALFORMED,
    SYNTAXES,
    TOOLS,
    ToolCall,
    ToolError,
    calculate,
    parse_call,
    unknown_tool,
)
from rollout_svc.engines.base import Completion, Engine
from rollout_svc.modes import ModeError, Tokens, group_of, sample_seed, sampled, trajectory_id
from rollout_svc.modes.env_chat import ChatError, render_chat

# tools run here, beside the event loop; one that hangs keeps its worker until it returns
_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="loom-agent-tool")


@dataclass(frozen=True)
class Observation:
    text: str
    status: str  # ok | malformed | unknown_tool | tool_error | timeout
    truncated: bool = False


async def run_tool(call: ToolCall | None, enabled: list[str], timeout_s: float) -> Observation:
    """The observation of ``call`` (None: a malformed call); never raises."""
    if call is None:
        return Observation(MALFORMED, "malformed")
    if call.name not in enabled or call.name not in TOOLS:
        return Observation(unknown_tool(call.name, enabled), "unknown_tool")
    loop = asyncio.get_running_loop()
    try:
        out = await asyncio.wait_for(loop.run_in_executor(_POOL, TOOLS[call.name], call.arguments), timeout_s)
    except TimeoutError:
        return Observation(f"error: tool {call.name} timed out after {timeout_s:g} s", "timeout")
    except ToolError as exc:
        return Observation(f"error: {exc}", "tool_error")
    except Exception as exc:  # a tool's bug is the episode's observation, not the group's failure
        return Observation(
            f"error: tool {call.name} raised {type(exc).__name__}: {str(exc)[:200]}", "tool_error"
        )
    return Observation(str(out), "ok")


# ------------------------------------------------------------------------------------------------
# the episode

Policy = Callable[[list[int], int, int], Awaitable[Completion]]  # (ids, max tokens, turn) -> a turn


@dataclass
class Episode(Tokens):
    """One sample's running completion: policy and observation tokens, in order."""

    turns: int = 0
    tool_calls: int = 0
    stop: str = "no_tool_call"
    finish: FinishReason = "stop"
    env: EnvSession | None = None  # the episode's environment on the env tier, when it has one
    rewards: list[float | None] = field(default_factory=list)  # the environment's, per turn
    env_error: str | None = None  # why the environment ended the episode, when it failed
    env_steps: int = 0  # the turns the environment answered (a step per turn, a tool call or not)
    replayed: int = 0  # the steps replayed to reopen it (an agent_tree child's, env_replay.py)
    # the prompt it is conditioned on where its environment's system prompt and tools were rendered
    # with the question (env_chat.py), and how; None: the request's
    prompt_ids: list[int] | None = None
    prompt_how: str | None = None

    def segment_index(self) -> int:
        return self.turns - 1  # the turn under way

    def end(self, stop: str, finish: FinishReason) -> None:
        self.stop, self.finish = stop, finish


class Agent:
    """One group's episodes: the engine, tokenizer, parser and limits they share, and the loop."""

    def __init__(self, request: RolloutRequest, engine: Engine, tokenizer: Any, cfg: AgentParams):
        self.engine, self.tokenizer, self.cfg, self.sampling = engine, tokenizer, cfg, request.sampling
        self.request = request
        self.syntax = SYNTAXES[cfg.parser]
        self.markers = [m for m in (self.syntax.call_open, self.syntax.call_close) if m]
        try:
            self.close_ids = marker_ids(tokenizer, self.syntax.call_close)
            for m in self.markers:
                marker_ids(tokenizer, m)
        except MarkerError as exc:
            raise ModeError(f"agent: {exc}") from None
        self.by_ids = len(self.close_ids) == 1 or "stop_sequences" in engine.capabilities

    def encode(self, text: str) -> list[int]:
        return encode_with_markers(self.tokenizer, text, self.markers)

    def policy(self, seed_key: int) -> Policy:
        """The engine's turn: decode until the call's close tag (its canonical ids) or the end."""

        async def turn(ids: list[int], max_tokens: int, k: int) -> Completion:
            params = self.turn_params(max_tokens, sample_seed(self.sampling.seed, seed_key, k))
            return (await self.engine.generate(ids, params))[0]

        return turn

    def turn_params(self, max_tokens: int, seed: int | None, n: int = 1) -> SamplingParams:
        """A turn's sampling: the request's, stopped at the call's close tag (its canonical ids)."""
        close = self.close_ids
        return self.sampling.model_copy(
            update={
                "n": n,
                "max_tokens": max_tokens,
                "stop": [] if self.by_ids else [self.syntax.call_close],
                "stop_token_ids": close if len(close) == 1 else [],
                "stop_token_sequences": [close] if len(close) > 1 and self.by_ids else [],
                "seed": seed,
            }
        )

    def observation(self, obs: Observation) -> tuple[list[int], Observation]:
        """The observation's ids: its text (cut to ``max_observation_tokens``, marked) in the fixed
        response wrapper, encoded alone."""
        cap = self.cfg.max_observation_tokens
        body = self.tokenizer.encode(obs.text, add_special_tokens=False)
        if len(body) > cap:
            cut = self.tokenizer.decode(body[:cap], skip_special_tokens=True)
            obs = Observation(f"{cut}... [truncated {len(body) - cap} tokens]", obs.status, True)
        return self.encode(self.syntax.response.format(output=obs.text)), obs

    async def episode(self, prompt_ids: list[int], policy: Policy, ep: Episode | None = None) -> Episode:
        cfg, ep = self.cfg, ep or Episode()
        deadline = time.monotonic() + cfg.deadline_s
        while True:
            if ep.turns >= cfg.max_turns:
                ep.end("max_turns", "length")
                break
            if time.monotonic() >= deadline:
                ep.end("deadline", "abort")
                break
            left = cfg.max_total_tokens - len(ep.ids)
            budget, why = min((self.sampling.max_tokens, "max_turn_tokens"), (left, "max_total_tokens"))
            room = self.engine.room(prompt_ids + ep.ids)
            if room is not None and room < budget:
                budget, why = room, "context"
            if budget <= 0:
                ep.end(why, "length")
                break
            c = await policy(prompt_ids + ep.ids, budget, ep.turns)
            ep.turns += 1
            called = c.finish_reason == "stop" and ends_with(c.token_ids, self.close_ids)
            call = None
            if called:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=False)
                call = parse_call(text, cfg.parser)
            meta: dict[str, Any] = {
                "tool_call": None if call is None else {"name": call.name, "arguments": call.arguments},
                "status": "no_tool_call" if not called else ("ok" if call is not None else "malformed"),
            }
            ep.append(c.token_ids, c.logprobs, 1, "turn", meta)
            if ep.env is not None:  # the environment answers every turn (docs/environments.md)
                if await self.env_turn(ep, call, deadline):
                    break
                continue
            if not called:
                ep.end("no_tool_call", "stop") if c.finish_reason == "stop" else ep.end(why, "length")
                break
            if ep.turns >= cfg.max_turns:
                ep.end("max_turns", "length")
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ep.end("deadline", "abort")
                break
            obs = await run_tool(call, cfg.tools, min(cfg.tool_timeout_s, remaining))
            ids, obs = self.observation(obs)
            ep.tool_calls += 1
            ep.segments[-1].meta["status"] = obs.status  # the turn's call, as it ran
            if len(ids) > cfg.max_total_tokens - len(ep.ids):
                ep.end("max_total_tokens", "length")
                break
            ep.append(
                ids,
                [0.0] * len(ids),
                0,
                "observation",
                {
                    "tool": None if call is None else call.name,
                    "status": obs.status,
                    "truncated": obs.truncated,
                },
            )
        return ep

    async def env_episode(self, prompt_ids: list[int], policy: Policy, r: int) -> Episode:
        """An episode in ``cfg.environment`` on the env tier (docs/environments.md): opened with the
        task, its reset observation (if any) before the first turn, closed however the episode ends;
        an environment that could not be opened ends it at once with its status."""
        if self.cfg.environment is None:
            return await self.episode(prompt_ids, policy)
        ep, opened = await self.open_episode(prompt_ids, r)
        if not opened:
            return ep
        try:
            return await self.episode(prompt_ids if ep.prompt_ids is None else ep.prompt_ids, policy, ep)
        finally:
            await ep.env.close()  # type: ignore[union-attr]

    def env_task(self, prompt_ids: list[int], r: int, replay: bool = False) -> EnvTask:
        """Sample ``r``'s task (raises ValidationError: a label past the environment's bound)."""
        req = self.request
        question = req.prompt if req.prompt is not None else self.tokenizer.decode(prompt_ids)
        return EnvTask(
            environment=self.cfg.environment or "",
            question=question[:MAX_ACTION_CHARS],
            label=req.label,
            options=self.cfg.env_options,
            seed=sample_seed(req.sampling.seed, r) or r,
            replay=replay,
        )

    async def open_episode(self, prompt_ids: list[int], r: int, replay: bool = False) -> tuple[Episode, bool]:
        """A new episode with sample ``r``'s environment open and its reset observation appended, and
        True; or, where it could not be opened, the episode ended with the status (closed) and False.
        ``replay``: the episode is a tree's, to be replayed (a non-replayable environment refuses)."""
        try:
            task = self.env_task(prompt_ids, r, replay)
        except ValidationError as exc:
            ep = Episode(env_error=f"the episode's task: {str(exc)[:300]}")
            ep.end("env_error", "abort")
            return ep, False
        ep = Episode(env=await EnvSession.open(get_env_client(), task))
        assert ep.env is not None
        reset = ep.env.reset
        if reset.status != "ok":
            ep.env_error = reset.error
            ep.end(reset.status, "abort")
            await ep.env.close()
            return ep, False
        if reset.chat is not None:  # the env's system prompt and tools: the policy's prompt renders them
            try:
                if replay:
                    raise ChatError(
                        "a tree's episodes share the request's prompt: an environment with a "
                        "system prompt or tools cannot be replayed in one"
                    )
                rendered = render_chat(self.tokenizer, task.question, reset.chat)
            except ChatError as exc:
                ep.env_error = str(exc)[:500]
                ep.end("env_error", "abort")
                await ep.env.close()
                return ep, False
            ep.prompt_ids, ep.prompt_how = rendered.ids, rendered.how
        if reset.observation:
            ids, obs = self.observation(Observation(reset.observation, "ok"))
            meta = {"env": self.cfg.environment, "status": "ok", "truncated": obs.truncated}
            ep.append(ids, [0.0] * len(ids), 0, "observation", meta)
        return ep, True

    async def env_turn(self, ep: Episode, call: ToolCall | None, deadline: float) -> bool:
        """The episode's last turn (its whole text: a tree child's includes its parent's head) as the
        environment's step: its reward in the turn's meta, its observation appended as a tool's is;
        True when the episode ends (done, the env lost, or the episode's limits)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            ep.end("deadline", "abort")
            return True
        turn = ep.segments[-1]
        text = self.tokenizer.decode(ep.ids[turn.start : turn.end], skip_special_tokens=False)
        assert ep.env is not None
        step = await ep.env.step(text, call, ep.turns - 1, min(self.cfg.tool_timeout_s, remaining))
        ep.segments[-1].meta.update(env_status=step.status, reward=step.reward)
        ep.rewards.append(step.reward)
        ep.tool_calls += call is not None
        ep.env_steps += 1
        if step.status == "env_lost":
            ep.env_error = step.error
        if step.status == "env_lost" or step.done:
            ep.end("env_lost", "abort") if step.status == "env_lost" else ep.end("env_done", "stop")
            return True
        if ep.turns >= self.cfg.max_turns:
            ep.end("max_turns", "length")
            return True
        ids, obs = self.observation(Observation(step.observation, step.status))
        if len(ids) > self.cfg.max_total_tokens - len(ep.ids):
            ep.end("max_total_tokens", "length")
            return True
        meta = {"env": self.cfg.environment, "status": step.status, "truncated": obs.truncated}
        ep.append(ids, [0.0] * len(ids), 0, "observation", meta | {"reward": step.reward})
        return False


# what agent() takes beyond (request, prompt_ids, group_id, engine), in its order
NEEDS = ("tokenizer", "params")


async def agent(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: AgentParams,
) -> Group:
    runner = Agent(request, engine, tokenizer, cfg)
    t0 = time.perf_counter()
    episodes = await asyncio.gather(
        *(runner.env_episode(prompt_ids, runner.policy(r), r) for r in range(request.sampling.n))
    )
    wall = time.perf_counter() - t0
    trajectories = [trajectory(group_id, r, prompt_ids, ep, engine, wall) for r, ep in enumerate(episodes)]
    return group_of(
        request,
        group_id,
        "agent",
        trajectories,
        meta={
            "turns": sum(ep.turns for ep in episodes),
            "tool_calls": sum(ep.tool_calls for ep in episodes),
            "stop": [ep.stop for ep in episodes],
            "wall_s": wall,
        },
    )


def trajectory(
    group_id: str, r: int, prompt_ids: list[int], ep: Episode, engine: Engine, wall: float
) -> Trajectory:
    return sampled(
        engine,
        trajectory_id(group_id, r),
        group_id,
        prompt_ids if ep.prompt_ids is None else ep.prompt_ids,
        completion_ids=ep.ids,
        logprobs=ep.logprobs,
        loss_mask=ep.mask,
        segments=ep.segments,
        finish_reason=ep.finish,
        stop_reason=ep.stop,
        timing={"generate_s": wall},
        meta={"turns": ep.turns, "tool_calls": ep.tool_calls, "stop": ep.stop} | env_meta(ep),
    )


def env_meta(ep: Episode) -> dict[str, Any]:
    """An environment's episode's own meta: its per-turn rewards, why it failed, its steps."""
    if ep.env is None and ep.env_error is None:
        return {}
    meta = {"turn_rewards": ep.rewards, "env_error": ep.env_error, "env_steps": ep.env_steps}
    return meta | ({} if ep.prompt_how is None else {"env_prompt": ep.prompt_how})
