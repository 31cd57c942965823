"""agent_tree (docs/algorithms.md §2.6): TreeRL's tree search over agent episodes.

``initial`` agent episodes (rollout_svc/modes/agent.py: policy turns and tool observations on one
running id sequence) are sampled; then, for ``iterations`` rounds, ``branches`` points per tree are
picked over all its paths and each is continued ``continuations`` times (one engine call with n = T
from the exact prefix, so a prefix-caching engine computes only the new tokens), every child going on
as an episode of its own: its later turns, tool calls and observations are its own.

- **Branch points** (``strategy``): ``turn``, the start of a turn that follows an observation (the
  policy's first decision after a tool answered), most uncertain first (the highest -log-prob of the
  turn's first token); ``entropy`` (TreeRL), the policy tokens with the highest -log-prob inside any
  turn, never the first token of the episode, nothing from the first stop word (``"answer"``,
  ``"conclusion"``) on; ``attention`` (AttnRL's ATB, tree mode's rule over episodes), the earliest
  reasoning steps whose FCI (loom/fci.py, eq. 5-6, ``delta``) is at least the ``quantile`` of the
  tree's eligible steps (eq. 7). An episode's steps are the policy's own: each turn split after every
  token that completes ``separator`` (``fallback_separator`` for a turn it leaves with fewer than 3
  steps, tree mode's ``split_steps``), a turn's first token always a step start; an observation is no
  step. The FCI is scored over the whole episode (prompt, turns and observations, the prompt step 0)
  by the engine's own scorer or the operator's (``LOOM_ATTENTION_URL``, rollout_svc/modes/scorers.py);
  with neither the group is ``UnsupportedCapability`` before any token is sampled, and a failing
  scorer is its typed ``ScorerError``, as in tree mode; the episode's first step and the steps from
  the first stop word on score 0. All three never pick an observation token, a point already taken,
  or a point within ``min_distance`` of another on the same path (tree mode's ``spaced_points``).
- **Exact prefixes**: a child's completion is the parent's ids up to the branch point + its own;
  nothing is re-tokenized. A point inside a turn continues that turn (the turn's call is parsed from
  the whole turn, prefix included); the tool observations of the shared prefix are the parent's,
  computed once.
- **The tree**: every path is a trajectory (``parent_id`` the path it branched from); ``Group.tree``
  holds the nodes (a path's spans cut at its branch points, the first hanging from the parent's node
  that ends at the branch point: tree mode's shape), and every trajectory carries a ``tree_node``
  segment per node on its path beside its ``turn`` and ``observation`` segments, so §5.1 ``treerl``
  (loom/treerl.py) computes node advantages over the episodes. Observation tokens keep loss mask 0;
  the copied prefix is trained (``train_prefix``).
- **Environments**: an environment's state is not in the ids, so a child reopens it and replays its
  parent's actions, each answer checked (rollout_svc/modes/env_replay.py); a non-replayable
  ``mode_params.environment`` is refused (AgentTreeParams).

The group reports the policy tokens the tree generated against those its leaves hold (what sampling
each leaf from scratch would decode) and the tool calls it ran against those its leaves hold;
``attention`` adds each scored path's steps and their FCI (``steps``, ``fci``) and, on a branch, the
FCI of the step it starts (``branch_fci``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.contracts.modes import AgentTreeParams, replayable_environment
from loom.contracts.settings import get_settings
from loom.contracts.wire import FinishReason, Group, RolloutRequest, Segment, Trajectory, TreeNode
from loom.formats import ends_with
from rollout_svc.engines.base import Completion, Engine
from rollout_svc.modes import ModeError, env_replay, group_of, sample_seed, sampled, trajectory_id
from rollout_svc.modes.agent import Agent, Episode, env_meta, parse_call, run_tool
from rollout_svc.modes.scorers import PolicyScorer, Scorer, resolve_scorer
from rollout_svc.modes.tree import (
    Point,
    attention_ranked,
    decoded_tokens,
    entropy_mask,
    entropy_ranked,
    spaced_points,
    split_steps,
    tree_nodes,
)

# a branch call's seed round: past every turn number (AgentParams.max_turns <= 64)
BRANCH_ROUND = 64


@dataclass
class _Path:
    """One episode of a tree: a root (``start`` 0) or a child continuing ``parent``'s first ``start``
    completion tokens."""

    tid: str
    index: int  # position among the group's paths: its turns' seeds
    tree: int
    ep: Episode
    start: int = 0
    parent: _Path | None = None
    iteration: int = 0
    branch_index: int = 0
    seconds: float = 0.0
    cuts: list[int] = field(default_factory=list)  # its own branch points, in the order taken
    steps: list[tuple[int, int]] | None = None  # attention: its reasoning steps (completion offsets)
    fci: list[float] | None = None  # attention: each step's FCI (zeroed)


def episode_steps(ep: Episode, texts: list[str], cfg: AgentTreeParams) -> list[tuple[int, int]]:
    """The policy's reasoning steps of ``ep`` (completion offsets): each turn split by tree mode's
    ``split_steps``; observations are no step."""
    out: list[tuple[int, int]] = []
    for s in ep.segments:
        if s.kind == "turn" and s.end > s.start:
            spans = split_steps(texts[s.start : s.end], cfg.separator, cfg.fallback_separator)
            out += [(s.start + a, s.start + b) for a, b in spans]
    return out


def prefix_of(ep: Episode, b: int) -> tuple[Episode, list[int], list[float]]:
    """``ep`` cut at completion offset ``b``: the finished segments before it, and the turn ``b`` falls
    inside (its tokens before ``b``: the head a child's first turn continues; empty at a turn start)."""
    inside = next((s for s in ep.segments if s.start < b < s.end), None)
    if inside is not None and inside.kind != "turn":
        raise ValueError(f"branch point {b} is inside an {inside.kind} segment")
    cut = b if inside is None else inside.start
    segs = [s.model_copy(deep=True) for s in ep.segments if s.end <= cut]
    child = Episode(
        ids=ep.ids[:cut],
        logprobs=ep.logprobs[:cut],
        mask=ep.mask[:cut],
        segments=segs,
        turns=sum(s.kind == "turn" for s in segs),
        tool_calls=sum(s.kind == "observation" for s in segs),
    )
    return child, ep.ids[cut:b], ep.logprobs[cut:b]


@dataclass
class _Walker:
    """One group's episodes: the agent's pieces (parser, tools, observations, turn sampling) and the
    loop that runs an episode from any state: a fresh one, or a child's copied prefix."""

    agent: Agent
    prompt_ids: list[int]
    cfg: AgentTreeParams

    def budget(self, ep: Episode, head: list[int]) -> tuple[int, str]:
        """The next turn's token budget (``head``: the tokens the turn already has) and what bounds it."""
        left = self.cfg.max_total_tokens - len(ep.ids) - len(head)
        turn = self.agent.sampling.max_tokens - len(head)
        budget, why = min((turn, "max_turn_tokens"), (left, "max_total_tokens"))
        room = self.agent.engine.room(self.prompt_ids + ep.ids + head)
        if room is not None and room < budget:
            budget, why = room, "context"
        return budget, why

    async def sample(
        self, ep: Episode, head: list[int], budget: int, seed: int | None, n: int
    ) -> list[Completion]:
        params = self.agent.turn_params(budget, seed, n)
        return await self.agent.engine.generate(self.prompt_ids + ep.ids + head, params)

    async def walk(
        self,
        ep: Episode,
        key: int,
        first: Completion | None = None,
        head: tuple[list[int], list[float]] = ([], []),
        why: str = "max_turn_tokens",
    ) -> Episode:
        """Run ``ep`` to its end (agent.py's loop); ``first``: its next turn's continuation, already
        sampled (a branch's), after the turn's ``head``."""
        cfg, deadline = self.cfg, time.monotonic() + self.cfg.deadline_s
        while True:
            if ep.turns >= cfg.max_turns:
                ep.end("max_turns", "length")
                return ep
            if time.monotonic() >= deadline:
                ep.end("deadline", "abort")
                return ep
            if first is None:
                budget, why = self.budget(ep, head[0])
                if budget <= 0:
                    ep.end(why, "length")
                    return ep
                seed = sample_seed(self.agent.sampling.seed, key, ep.turns)
                first = (await self.sample(ep, head[0], budget, seed, 1))[0]
            c, first = first, None
            ep.turns += 1
            if not await self.after_turn(ep, head[0] + c.token_ids, head[1] + c.logprobs, c, why, deadline):
                return ep
            head = ([], [])

    async def after_turn(
        self, ep: Episode, ids: list[int], logprobs: list[float], c: Completion, why: str, deadline: float
    ) -> bool:
        """Append the turn; run its call and append the observation. False: the episode ended."""
        cfg, agent = self.cfg, self.agent
        called = c.finish_reason == "stop" and ends_with(ids, agent.close_ids)
        call = (
            parse_call(agent.tokenizer.decode(ids, skip_special_tokens=False), cfg.parser) if called else None
        )
        meta: dict[str, Any] = {
            "tool_call": None if call is None else {"name": call.name, "arguments": call.arguments},
            "status": "no_tool_call" if not called else ("ok" if call is not None else "malformed"),
        }
        ep.append(ids, logprobs, 1, "turn", meta)
        if ep.env is not None:  # the environment answers every turn (agent.py, env_replay.py)
            return not await agent.env_turn(ep, call, deadline)
        stop: tuple[str, FinishReason] | None = None
        if not called:
            stop = ("no_tool_call", "stop") if c.finish_reason == "stop" else (why, "length")
        elif ep.turns >= cfg.max_turns:
            stop = ("max_turns", "length")
        elif deadline - time.monotonic() <= 0:
            stop = ("deadline", "abort")
        if stop is not None:
            ep.end(*stop)
            return False
        obs = await run_tool(call, cfg.tools, min(cfg.tool_timeout_s, deadline - time.monotonic()))
        obs_ids, obs = agent.observation(obs)
        ep.tool_calls += 1
        ep.segments[-1].meta["status"] = obs.status
        if len(obs_ids) > cfg.max_total_tokens - len(ep.ids):
            ep.end("max_total_tokens", "length")
            return False
        meta = {"tool": None if call is None else call.name, "status": obs.status, "truncated": obs.truncated}
        ep.append(obs_ids, [0.0] * len(obs_ids), 0, "observation", meta)
        return True


def _candidates(p: _Path, cfg: AgentTreeParams, texts: list[str]) -> list[tuple[float, int]]:
    """(score, position) of ``p``'s own eligible branch points (module docstring): the log-prob
    (``turn``, ``entropy``) or the step's FCI (``attention``: a step start, > 0 once zeroed)."""
    ep, out = p.ep, []
    if cfg.strategy == "attention":
        ok = entropy_mask(texts, cfg.entropy_stop_words)
        return [
            (v, a)
            for (a, _), v in zip(p.steps or [], p.fci or [], strict=False)
            if v > 0.0 and a > p.start and ok[a]
        ]
    if cfg.strategy == "turn":
        for s in ep.segments:
            if s.kind == "turn" and s.index > 0 and s.start > p.start and s.start < len(ep.ids):
                out.append((ep.logprobs[s.start], s.start))
        return out
    ok = entropy_mask(texts, cfg.entropy_stop_words)
    for s in ep.segments:
        if s.kind == "turn":
            out += [(ep.logprobs[i], i) for i in range(max(s.start, p.start + 1), s.end) if ok[i]]
    return out


def pick(paths: Sequence[_Path], cfg: AgentTreeParams, texts_of: Any) -> list[tuple[_Path, int]]:
    """One round's branch points of one tree, pooled over its paths (``texts_of(path)``: its tokens'
    texts), ranked by the strategy (most uncertain first; ``attention``: the earliest candidates of
    eq. 7), spaced."""
    scored: list[tuple[Any, float, int]] = []
    for k, p in enumerate(paths):
        scored += [(k, v, i) for v, i in _candidates(p, cfg, texts_of(p)) if i not in p.cuts]
    ranked: list[Point] = (
        attention_ranked(scored, cfg.quantile) if cfg.strategy == "attention" else entropy_ranked(scored)
    )
    taken = {k: list(p.cuts) for k, p in enumerate(paths)}
    picked = spaced_points(ranked, cfg.branches, cfg.min_distance, taken)
    return [(paths[k], b) for k, b in sorted(picked)]


@dataclass
class _Forest:
    """One prompt's trees: the walker, the group's paths, and the rounds that grow them."""

    walker: _Walker
    group_id: str
    scorer: Scorer | None = None  # attention: the FCI scorer (resolve_scorer's)
    paths: list[_Path] = field(default_factory=list)
    cache: dict[int, str] = field(default_factory=dict)  # token id -> text

    def texts(self, p: _Path) -> list[str]:
        return decoded_tokens(self.walker.agent.tokenizer, p.ep.ids, self.cache)

    async def score(self, p: _Path) -> None:
        """FCI of each of ``p``'s steps (once), over the whole episode: the prompt is step 0, the
        observations are read but are no step; the steps from the first stop word on score 0."""
        if p.fci is not None or self.scorer is None:
            return
        cfg, texts = self.walker.cfg, self.texts(p)
        p.steps = episode_steps(p.ep, texts, cfg)
        if not p.steps:
            p.fci = []
            return
        ok = entropy_mask(texts, cfg.entropy_stop_words)
        cut = next((s for s, (a, _) in enumerate(p.steps) if s > 0 and not ok[a]), None)
        prompt = self.walker.prompt_ids
        n = len(prompt)
        spans = [(0, n)] + [(n + a, n + b) for a, b in p.steps]
        scores = await self.scorer(prompt + p.ep.ids, spans, cfg.delta, None if cut is None else cut + 1)
        p.fci = [float(x) for x in scores[1:]]

    async def roots(self, m: int) -> None:
        t0 = time.perf_counter()
        env = self.walker.cfg.environment is not None
        walk = self.walker.walk
        eps = await asyncio.gather(
            *(env_replay.root(self.walker, i) if env else walk(Episode(), i) for i in range(m))
        )
        dt = time.perf_counter() - t0
        self.paths = [
            _Path(trajectory_id(self.group_id, i), i, i, ep, seconds=dt) for i, ep in enumerate(eps)
        ]

    async def grow(self) -> None:
        cfg = self.walker.cfg
        trees: dict[int, list[_Path]] = {p.tree: [p] for p in self.paths}
        for it in range(cfg.iterations):
            jobs: list[Awaitable[list[_Path]]] = []
            if cfg.strategy == "attention":
                await asyncio.gather(*(self.score(q) for q in self.paths))
            for tree_paths in trees.values():
                live = [q for q in tree_paths if q.ep.stop != env_replay.REPLAY_MISMATCH]
                for p, b in pick(live, cfg, self.texts):
                    index = len(self.paths) + cfg.continuations * len(jobs)  # its children's seeds
                    jobs.append(self.branch(p, len(p.cuts), b, it + 1, index))
                    p.cuts.append(b)
            if not jobs:
                return
            for children in await asyncio.gather(*jobs):
                for child in children:
                    self.paths.append(child)
                    trees[child.tree].append(child)

    async def branch(self, p: _Path, k: int, b: int, iteration: int, index: int) -> list[_Path]:
        """T children of ``p`` at ``b``: one engine call from the exact prefix, then each its own episode."""
        walker, t0 = self.walker, time.perf_counter()
        ep, head, head_lp = prefix_of(p.ep, b)
        budget, why = walker.budget(ep, head)
        if budget <= 0:
            return []
        seed = sample_seed(walker.agent.sampling.seed, p.index, BRANCH_ROUND + k)
        sampled = walker.sample(ep, head, budget, seed, walker.cfg.continuations)
        if walker.cfg.environment is not None:  # each child's environment reopened and replayed
            prefixes = [prefix_of(p.ep, b)[0] for _ in range(walker.cfg.continuations)]
            eps = await env_replay.children(walker, prefixes, p.tree, sampled, index, (head, head_lp), why)
        else:
            firsts = await sampled
            eps = await asyncio.gather(
                *(
                    walker.walk(prefix_of(p.ep, b)[0], index + j, c, (head, head_lp), why)
                    for j, c in enumerate(firsts)
                )
            )
        dt = time.perf_counter() - t0
        return [
            _Path(f"{p.tid}.b{k}.{j}", index + j, p.tree, e, b, p, iteration, k, dt)
            for j, e in enumerate(eps)
        ]


def node_segments(nodes: list[TreeNode], node_at: dict[tuple[str, int], str], p: _Path) -> list[Segment]:
    """``p``'s ``tree_node`` segments: one per non-empty node on its path, root first."""
    by_id = {n.id: n for n in nodes}
    path: list[TreeNode] = []
    cur: str | None = node_at[(p.tid, len(p.ep.ids))]
    while cur is not None:
        path.append(by_id[cur])
        cur = by_id[cur].parent
    return [
        Segment(kind="tree_node", start=n.start, end=n.end, index=d, meta={"node": n.id})
        for d, n in enumerate(reversed(path))
        if n.end > n.start
    ]


def policy_tokens(ep: Episode, start: int = 0) -> int:
    """The policy's tokens of ``ep`` from ``start`` on (its turns'; observations are the tools')."""
    return sum(max(0, s.end - max(s.start, start)) for s in ep.segments if s.kind == "turn")


def trajectory_of(
    p: _Path, group_id: str, prompt_ids: list[int], engine: Engine, cfg: AgentTreeParams
) -> Trajectory:
    ep = p.ep
    mask = list(ep.mask)
    if p.parent is not None and not cfg.train_prefix:
        mask[: p.start] = [0] * p.start
    meta: dict[str, Any] = {"turns": ep.turns, "tool_calls": ep.tool_calls, "stop": ep.stop} | env_meta(ep)
    if p.parent is not None:
        meta |= {"branch_point": p.start, "branch_index": p.branch_index, "strategy": cfg.strategy}
        meta |= {"iteration": p.iteration}
        at = [v for (a, _), v in zip(p.parent.steps or [], p.parent.fci or [], strict=False) if a == p.start]
        if at:  # the FCI of the parent's step this branch starts (AttnRL eq. 6)
            meta["branch_fci"] = at[0]
    return sampled(
        engine,
        p.tid,
        group_id,
        prompt_ids,
        completion_ids=list(ep.ids),
        logprobs=list(ep.logprobs),
        loss_mask=mask,
        segments=list(ep.segments),
        finish_reason=ep.finish,
        stop_reason=ep.stop,
        parent_id=None if p.parent is None else p.parent.tid,
        timing={"generate_s": p.seconds},
        meta=meta,
    )


# what agent_tree() takes beyond (request, prompt_ids, group_id, engine), in its order
# (rollout_svc.modes.PROVIDERS gives each)
NEEDS = ("tokenizer", "params", "scorer")


async def agent_tree(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: AgentTreeParams,
    scorer: PolicyScorer | None = None,
) -> Group:
    """One prompt's tree of episodes (module docstring). ``scorer``: the operator's attention scorer,
    used by ``attention`` when the engine has none of its own."""
    name = cfg.environment  # AgentTreeParams refuses a non-replayable one; a direct caller too
    if name is not None and not replayable_environment(name, get_settings().env_modules):
        raise ModeError(f"agent_tree: mode_params.environment {name!r} is not replayable, it cannot branch")
    scoring = resolve_scorer(engine, scorer) if cfg.strategy == "attention" else None
    walker = _Walker(Agent(request, engine, tokenizer, cfg), list(prompt_ids), cfg)
    forest = _Forest(walker, group_id, scoring)
    t0 = time.perf_counter()
    await forest.roots(cfg.initial)
    await forest.grow()
    paths = forest.paths
    nodes, node_at = tree_nodes(paths, lambda p: len(p.ep.ids))
    trajectories = []
    for p in paths:
        t = trajectory_of(p, group_id, prompt_ids, engine, cfg)
        t.segments = t.segments + node_segments(nodes, node_at, p)
        trajectories.append(t)
    generated = sum(policy_tokens(p.ep, p.start) for p in paths)
    independent = sum(policy_tokens(p.ep) for p in paths)
    calls_run = sum(sum(s.kind == "observation" and s.start >= p.start for s in p.ep.segments) for p in paths)
    meta: dict[str, Any] = {
        "strategy": cfg.strategy,
        "initial": cfg.initial,
        "iterations": cfg.iterations,
        "n_leaves": len(trajectories),
        "branch_points": {p.tid: sorted(p.cuts) for p in paths if p.cuts},
        "tokens_generated": generated,
        "tokens_independent": independent,
        "token_ratio": generated / independent if independent else 1.0,
        "tool_calls_run": calls_run,
        "tool_calls_independent": sum(p.ep.tool_calls for p in paths),
        "env_steps_replayed": sum(p.ep.replayed for p in paths),
        "turns": sum(p.ep.turns for p in paths),
        "stop": [p.ep.stop for p in paths],
        "generate_s": time.perf_counter() - t0,
    }
    if cfg.strategy == "attention":  # the scored paths' steps and their FCI, aligned
        meta["steps"] = {p.tid: [list(s) for s in p.steps] for p in paths if p.steps is not None}
        meta["fci"] = {p.tid: p.fci for p in paths if p.fci is not None}
    return group_of(request, group_id, "agent_tree", trajectories, tree=nodes, meta=meta)
