"""Environments under agent_tree, by replay (docs/environments.md "Trees by replay", docs/algorithms.md
§2.6).

An environment's state is not in the ids, so a child cannot continue its parent's environment; it
opens a fresh episode of the same environment with the same task (its tree's root sample: the same
question, label, options and seed), then replays the parent's actions (the text and parsed call of
every turn wholly before the branch point) in order, and checks each answer against the parent's: the
reset observation and every step's observation token for token (as rendered into the completion), its
status, its reward, and that it is not done. Only then does the child go on live from its branch
point. A point inside a turn continues that turn: its action was never sent, so the replay stops
before it. Any difference ends the child ``env_replay_mismatch`` (its first turn, sampled, appended
unsent; ``env_error`` says which step differed and how), never a trajectory whose copied observations
its own environment would not have given; an environment that cannot be reopened ends it with the
open's status. Only environments that declare themselves replayable are opened so
(``env_svc/base.py``; ``AgentTreeParams`` refuses the others by name).

Replays are the tree's cost in environment steps, reported beside the tool calls
(``env_steps_replayed``); each child's session is closed when it ends, a root's when its walk ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from loom.clients.env import EnvSession
from loom.tools import ToolCall
from rollout_svc.engines.base import Completion
from rollout_svc.modes.agent import Agent, Episode, Observation

if TYPE_CHECKING:
    from rollout_svc.modes.agent_tree import _Walker

REPLAY_MISMATCH = "env_replay_mismatch"


async def root(walker: _Walker, r: int) -> Episode:
    """Root ``r``'s episode: its environment opened (for replay: refused unless replayable), walked,
    closed."""
    ep, opened = await walker.agent.open_episode(walker.prompt_ids, r, replay=True)
    if not opened:
        return ep
    try:
        return await walker.walk(ep, r)
    finally:
        await ep.env.close()  # type: ignore[union-attr]


def _call(meta: dict) -> ToolCall | None:
    call = meta.get("tool_call")
    return None if call is None else ToolCall(call["name"], call["arguments"])


async def replay(agent: Agent, prompt_ids: list[int], child: Episode, r: int) -> tuple[str, str] | None:
    """Open ``child``'s environment (root sample ``r``'s task) and replay its copied prefix; None when
    every answer matched (``child.env`` is then live), else (stop reason, why)."""
    turns = [k for k, s in enumerate(child.segments) if s.kind == "turn"]
    # the prefix's steps, as the parent's environment answered them (prefix_of counts tools' answers)
    child.env_steps = len(turns)
    child.tool_calls = sum(_call(child.segments[k].meta) is not None for k in turns)
    child.rewards = [child.segments[k].meta.get("reward") for k in turns]
    fresh, opened = await agent.open_episode(prompt_ids, r, replay=True)
    child.env = fresh.env
    if not opened:
        return fresh.stop, fresh.env_error or fresh.stop
    first = child.segments[turns[0]].start if turns else len(child.ids)
    if fresh.ids != child.ids[:first]:
        return REPLAY_MISMATCH, "the reset observation differs from the parent's"
    assert child.env is not None
    for k in turns:
        s = child.segments[k]
        obs = child.segments[k + 1] if k + 1 < len(child.segments) else None
        if obs is None or obs.kind != "observation":  # a prefix's turns are each answered (agent_tree)
            return REPLAY_MISMATCH, f"turn {s.index} has no observation to check"
        call = _call(s.meta)
        text = agent.tokenizer.decode(child.ids[s.start : s.end], skip_special_tokens=False)
        step = await child.env.step(text, call, s.index, agent.cfg.tool_timeout_s)
        child.replayed += 1
        ids, _ = agent.observation(Observation(step.observation, step.status))
        got = (step.status, step.reward, step.done)
        want = (s.meta.get("env_status"), s.meta.get("reward"), False)
        if got != want:
            return REPLAY_MISMATCH, f"turn {s.index}: (status, reward, done) {got}, the parent's {want}"
        if ids != child.ids[obs.start : obs.end]:
            said = step.observation[:200]
            return REPLAY_MISMATCH, f"turn {s.index}: the observation differs from the parent's: {said!r}"
    return None


def _unsent(ep: Episode, head: tuple[list[int], list[float]], c: Completion, stop: str, why: str) -> Episode:
    """``ep`` ended where its replay failed: its sampled first turn appended (never sent), ``stop``."""
    ep.turns += 1
    meta = {"tool_call": None, "status": "not_sent", "env_status": stop}
    ep.append(head[0] + c.token_ids, head[1] + c.logprobs, 1, "turn", meta)
    ep.env_error = why
    ep.end(stop, "abort")
    return ep


async def children(
    walker: _Walker,
    prefixes: list[Episode],
    r: int,
    sampled: Awaitable[list[Completion]],
    index: int,
    head: tuple[list[int], list[float]],
    why: str,
) -> list[Episode]:
    """The children of one branch point: each prefix's environment reopened and replayed while the
    first turns are ``sampled``; each child then walked live from its first turn, or ended where its
    replay failed; every child's environment closed."""
    agent = walker.agent

    async def one(j: int, c: Completion, fail: tuple[str, str] | None) -> Episode:
        if fail is not None:
            return _unsent(prefixes[j], head, c, *fail)
        return await walker.walk(prefixes[j], index + j, c, head, why)

    try:
        replays = asyncio.gather(*(replay(agent, walker.prompt_ids, ep, r) for ep in prefixes))
        firsts, failed = await asyncio.gather(sampled, replays)
        return list(await asyncio.gather(*(one(j, c, failed[j]) for j, c in enumerate(firsts))))
    finally:  # a session a failed gather left open is reaped by its worker (Settings.env_idle_s)
        await asyncio.gather(*(_close(ep.env) for ep in prefixes))


async def _close(env: EnvSession | None) -> None:
    if env is not None:
        await env.close()
