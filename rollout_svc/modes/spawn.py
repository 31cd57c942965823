"""spawn (docs/algorithms.md §2.4; APR): the parent spawns child calls and joins their returned messages.

A call decodes until it closes a spawn block (``SpawnSyntax.spawn_close``, APR's Countdown syntax by
default) or ends. On a spawn block every child line becomes a child call whose own short context is
``child_template`` with the line's message; children decode concurrently (``asyncio.gather``: really
parallel on a batching server such as vLLM and on the in-process torch engine, which decodes concurrent
requests in one batch unless built with ``batching=False``; ``bench/spawn.py``). The parent
then resumes from its own trace (prompt + everything it generated, spawn block included, as in APR and
the tiny model's traces) plus a join block holding only each child's returned message (the text after
``think_close``, else ``no_solution``). The join block is an observation: in the sequence, loss mask 0.

A rollout is a forest of calls: every call is a Trajectory (``parent_id`` = the spawning call, ``meta``
root/depth) with its own loss mask; ``Group.threads`` holds the parent -> child links with the returned
message. Limits: ``max_children`` per block, ``max_depth`` (a child at the limit that spawns is a format
failure), ``child_max_tokens`` per child call, ``max_total_tokens`` over the rollout's calls.

A malformed spawn block (no opening marker, a line that is not a child line, no children, duplicate
child indices, an empty message, too many children, a spawn too deep, an unclosed block at EOS)
ends the rollout with a format failure: the offending call gets ``finish_reason="abort"`` and
``meta["status"] = "format_error"``, the rollout's calls stop after their current step, and
``Group.meta["rollouts"][r]["status"]`` says ``format_error`` with the reason. Never an exception.

Markers with any tokenizer (docs/models.md): the spawn close marker is matched on its canonical ids
(``loom.formats.marker_ids``): one id a stop token id, several a stop id sequence on an engine with
``stop_sequences`` (the torch engine); elsewhere (vLLM) its text is the stop string and the ids still
decide (a close written with other ids is a format error). The join block, a child's prompt and
its markers are inserted as canonical ids (``encode_with_markers``), and a child's returned message
is read after the canonical ids of ``think_close``: nothing re-tokenizes a call's history.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Any

from loom.contracts.modes import SpawnParams
from loom.contracts.wire import (
    FinishReason,
    Group,
    RolloutRequest,
    ThreadLink,
    Trajectory,
)
from loom.formats import (
    DEFAULT_SPAWN,
    MarkerError,
    SpawnSyntax,
    encode_with_markers,
    ends_with,
    marker_ids,
)
from rollout_svc.engines.base import Completion, Engine
from rollout_svc.modes import ModeError, Tokens, group_of, sample_seed, trajectory_id

# ------------------------------------------------------------------------------------------------
# parsing (pure)


@dataclass(frozen=True)
class SpawnChild:
    index: int
    node: str
    message: str


@dataclass(frozen=True)
class SpawnFormatError:
    reason: str


def _child_line(syntax: SpawnSyntax) -> re.Pattern[str]:
    pattern = re.escape(syntax.spawn_child)
    pattern = pattern.replace(re.escape("{i}"), r"(?P<i>\d{1,4})").replace(
        re.escape("{node}"), r"(?P<node>[^\s<>]{1,32})"
    )
    return re.compile(r"^" + pattern + r"(?:[ \t]+(?P<msg>.*))?$")


def _markers(syntax: SpawnSyntax) -> list[str]:
    return [syntax.spawn_open, syntax.spawn_close, syntax.join_open, syntax.join_close]


def parse_spawn_block(
    text: str, syntax: SpawnSyntax = DEFAULT_SPAWN, max_children: int = 64, max_message_chars: int = 512
) -> list[SpawnChild] | SpawnFormatError:
    """The children of the spawn block that ``text`` ends with (``text`` ends with ``spawn_close``).

    Strict: every non-empty line between the markers must be a child line with a non-empty message."""
    body = text.rstrip()
    if not body.endswith(syntax.spawn_close):
        return SpawnFormatError("the text does not end with the spawn close marker")
    body = body[: -len(syntax.spawn_close)]
    start = body.rfind(syntax.spawn_open)
    if start < 0:
        return SpawnFormatError("spawn close marker without an opening marker")
    block = body[start + len(syntax.spawn_open) :]
    if syntax.spawn_close in block:
        return SpawnFormatError("spawn close marker inside the block")
    line_re = _child_line(syntax)
    children: list[SpawnChild] = []
    for raw in block.splitlines():
        line = raw.strip()
        if not line:
            continue
        m = line_re.match(line)
        if m is None:
            return SpawnFormatError(f"not a child line: {line[:80]!r}")
        message = (m.group("msg") or "").strip()
        if not message:
            return SpawnFormatError(f"child {m.group('i')} has an empty message")
        if any(marker in message for marker in _markers(syntax)):
            return SpawnFormatError(f"child {m.group('i')} message contains a spawn/join marker")
        if len(message) > max_message_chars:
            return SpawnFormatError(f"child {m.group('i')} message exceeds {max_message_chars} characters")
        children.append(SpawnChild(int(m.group("i")), m.group("node"), message))
    if not children:
        return SpawnFormatError("spawn block with no children")
    if len({c.index for c in children}) != len(children):
        return SpawnFormatError("duplicate child indices")
    if len(children) > max_children:
        return SpawnFormatError(f"{len(children)} children exceed the limit of {max_children}")
    return children


def child_message(text: str, think_close: str = "</think>", no_solution: str = "No solution") -> str:
    """What a child returns: the text after ``think_close`` (APR: the solution path), else ``no_solution``."""
    if think_close not in text:
        return no_solution
    return text.split(think_close, 1)[1].strip() or no_solution


def join_text(messages: list[str], syntax: SpawnSyntax = DEFAULT_SPAWN) -> str:
    """The join block appended after a spawn block (the layout of zoo.tiny.traces.join_block)."""
    lines = [syntax.join_open, *(syntax.join_child.format(i=i, message=m) for i, m in enumerate(messages))]
    return "\n" + "\n".join([*lines, syntax.join_close]) + "\n"


# ------------------------------------------------------------------------------------------------
# the mode


@dataclass
class _Rollout:
    index: int
    budget: int
    status: str = "ok"
    reason: str = ""
    calls: list[Trajectory] = field(default_factory=list)
    links: list[ThreadLink] = field(default_factory=list)
    total_tokens: int = 0
    sequential: int = 0
    wall_s: float = 0.0

    def fail(self, reason: str) -> None:
        if self.status == "ok":
            self.status, self.reason = "format_error", reason


@dataclass
class _Call(Tokens):
    id: str
    prompt_ids: list[int]
    depth: int
    parent: str | None
    sequential: int = 0  # tokens on this call's longest dependent chain (own + slowest child per join)
    spans: int = 0  # generated spans so far (a span ends at a spawn block or at the call's end)
    finish: FinishReason = "stop"
    stop_reason: str | int | None = None
    status: str = "ok"

    def segment_index(self) -> int:
        return self.spans


class _Spawner:
    """One group's spawn rollouts: what every call shares (engine, tokenizer, syntax, limits) and the
    steps of a call: decode a span, spawn and join the children of its spawn block, resume."""

    def __init__(
        self, request: RolloutRequest, group_id: str, engine: Engine, tokenizer: Any, cfg: SpawnParams
    ):
        self.group_id, self.engine, self.tokenizer, self.cfg = group_id, engine, tokenizer, cfg
        self.syntax, self.sampling = cfg.syntax, request.sampling
        self.markers = [*_markers(self.syntax), cfg.think_close]
        try:  # every marker the mode inserts or matches, checked before any call
            ids = {m: marker_ids(tokenizer, m) for m in self.markers}
        except MarkerError as exc:
            raise ModeError(f"spawn: {exc}") from None
        self.close_ids, self.think_ids = ids[self.syntax.spawn_close], ids[cfg.think_close]
        # the close marker is one token: a stop id; several: a stop id sequence where the engine
        # matches one, else its text as the stop string (the ids still decide: ``decode_span``)
        self.by_ids = len(self.close_ids) == 1 or "stop_sequences" in engine.capabilities

    def encode(self, text: str) -> list[int]:
        return encode_with_markers(self.tokenizer, text, self.markers)

    async def rollout(self, r: int, prompt_ids: list[int]) -> _Rollout:
        ro = _Rollout(r, self.cfg.max_total_tokens)
        t0 = time.perf_counter()
        root = _Call(trajectory_id(self.group_id, r), list(prompt_ids), 0, None)
        await self.run_call(ro, root, self.sampling.max_tokens, r)
        ro.wall_s = time.perf_counter() - t0
        ro.sequential = root.sequential
        if ro.status != "ok":
            for t in ro.calls:
                t.meta["rollout_status"] = ro.status
        return ro

    async def run_call(self, ro: _Rollout, call: _Call, max_tokens: int, seed_key: int) -> Trajectory:
        """Decode ``call`` to its end, spawning and joining children at each spawn block."""
        t0 = time.perf_counter()
        while await self.decode_span(ro, call, max_tokens, seed_key):
            parsed = self.spawn_block(ro, call)
            if parsed is None:
                break
            messages, children = await self.run_children(ro, call, parsed, seed_key)
            if ro.status != "ok":
                break
            join = self.encode(join_text(messages, self.syntax))
            call.append(join, [0.0] * len(join), 0, "observation", {"join": [ch.id for ch in children]})
        traj = self.trajectory(ro, call, time.perf_counter() - t0)
        ro.calls.append(traj)
        return traj

    async def decode_span(self, ro: _Rollout, call: _Call, max_tokens: int, seed_key: int) -> bool:
        """Decode one span of ``call``; True when it ends with a spawn block (the rollout still ok)."""
        budget = min(max_tokens - len(call.ids), ro.budget)
        room = self.engine.room(call.prompt_ids + call.ids)  # a parent after its join may fill the context
        if room is not None:
            budget = min(budget, room)
        if budget <= 0:
            call.finish = "length"
            return False
        c = await self.generate(call, budget, seed_key)
        ro.budget -= len(c.token_ids)
        ro.total_tokens += len(c.token_ids)
        call.sequential += len(c.token_ids)
        call.append(c.token_ids, c.logprobs, 1, "thread", {})
        call.spans += 1
        call.finish, call.stop_reason = c.finish_reason, c.stop_reason
        if ro.status != "ok":
            return False
        spawned = c.finish_reason == "stop" and ends_with(c.token_ids, self.close_ids)
        if c.finish_reason == "stop" and c.stop_reason == self.syntax.spawn_close and not spawned:
            self.format_error(ro, call, "spawn close marker not written as its canonical token ids")
            return False
        if not spawned:
            text = self.tokenizer.decode(call.ids, skip_special_tokens=False)
            after_join = text.rsplit(self.syntax.join_close, 1)[-1]
            if (
                c.finish_reason == "stop" and self.syntax.spawn_open in after_join
            ):  # a cut by length is no format error
                self.format_error(ro, call, "unclosed spawn block")
        return spawned

    async def generate(self, call: _Call, budget: int, seed_key: int) -> Completion:
        sampling, syntax, close = self.sampling, self.syntax, self.close_ids
        params = sampling.model_copy(
            update={
                "n": 1,
                "max_tokens": budget,
                "stop": [] if self.by_ids else [syntax.spawn_close],
                "stop_token_ids": close if len(close) == 1 else [],
                "stop_token_sequences": [close] if len(close) > 1 and self.by_ids else [],
                "seed": sample_seed(sampling.seed, seed_key, call.spans),
            }
        )
        return (await self.engine.generate(call.prompt_ids + call.ids, params))[0]

    def spawn_block(self, ro: _Rollout, call: _Call) -> list[SpawnChild] | None:
        """The children of the spawn block ``call`` just closed; None (a format error) when the block
        is malformed or ``call`` is too deep to spawn."""
        text = self.tokenizer.decode(call.ids, skip_special_tokens=False)
        parsed = parse_spawn_block(text, self.syntax, self.cfg.max_children, self.cfg.max_message_chars)
        if isinstance(parsed, SpawnFormatError):
            self.format_error(ro, call, parsed.reason)
            return None
        if call.depth >= self.cfg.max_depth:
            self.format_error(ro, call, f"spawn at depth {call.depth} exceeds max_depth {self.cfg.max_depth}")
            return None
        return parsed

    async def run_children(
        self, ro: _Rollout, call: _Call, parsed: list[SpawnChild], seed_key: int
    ) -> tuple[list[str], list[_Call]]:
        """Run the children concurrently; their returned messages (linked from ``call``) and calls."""
        cfg, span = self.cfg, call.spans
        per_child = min(cfg.child_max_tokens, max(1, ro.budget // len(parsed)))
        children = [
            _Call(
                f"{call.id}.s{span - 1}c{ch.index}",
                self.encode(cfg.child_template.format(message=ch.message)),
                call.depth + 1,
                call.id,
            )
            for ch in parsed
        ]
        results = await asyncio.gather(
            *(
                self.run_call(ro, ch, per_child, seed_key * 131 + 7 * span + k + 1)
                for k, ch in enumerate(children)
            )
        )
        messages = []
        for ch, res in zip(children, results, strict=True):
            msg = self.returned_message(res.completion_ids)
            messages.append(msg)
            ro.links.append(ThreadLink(parent=call.id, child=ch.id, message=msg))
        call.sequential += max(ch.sequential for ch in children)
        return messages, children

    def returned_message(self, ids: list[int]) -> str:
        """What a child returns (``child_message``'s rule on ids): the text after the first canonical
        ``think_close`` ids, else ``no_solution``; found on ids, so a tokenizer that marks
        ``</think>`` special (and drops it when decoding) returns the same message."""
        close, n = self.think_ids, len(self.think_ids)
        at = next((k + n for k in range(len(ids) - n + 1) if ids[k : k + n] == close), None)
        if at is None:
            return self.syntax.no_solution
        return self.tokenizer.decode(ids[at:], skip_special_tokens=True).strip() or self.syntax.no_solution

    @staticmethod
    def format_error(ro: _Rollout, call: _Call, reason: str) -> None:
        ro.fail(reason)
        call.finish, call.status = "abort", "format_error"

    def trajectory(self, ro: _Rollout, call: _Call, seconds: float) -> Trajectory:
        return Trajectory(
            id=call.id,
            group_id=self.group_id,
            prompt_ids=call.prompt_ids,
            completion_ids=call.ids,
            logprobs=call.logprobs,
            logprobs_kind=self.engine.logprobs_kind,
            loss_mask=call.mask,
            segments=call.segments,
            finish_reason=call.finish,
            stop_reason=call.stop_reason,
            policy_version=self.engine.policy_version,
            engine=self.engine.name,
            timing={"generate_s": seconds},
            parent_id=call.parent,
            meta={
                "depth": call.depth,
                "root": trajectory_id(self.group_id, ro.index),
                "status": call.status,
                "sequential_tokens": call.sequential,
            },
        )


# what spawn() takes beyond (request, prompt_ids, group_id, engine), in its order
# (rollout_svc.modes.PROVIDERS gives each)
NEEDS = ("tokenizer", "params")


async def spawn(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: SpawnParams,
) -> Group:
    spawner = _Spawner(request, group_id, engine, tokenizer, cfg)
    t0 = time.perf_counter()
    rollouts = await asyncio.gather(*(spawner.rollout(r, prompt_ids) for r in range(request.sampling.n)))
    trajectories, links = [], []
    for ro in rollouts:
        ro.calls.sort(key=lambda t: (t.meta["depth"], t.id))
        trajectories += ro.calls
        links += ro.links
    return group_of(
        request,
        group_id,
        "spawn",
        trajectories,
        threads=links,
        meta={
            "rollouts": [_summary(group_id, ro) for ro in rollouts],
            "total_tokens": sum(ro.total_tokens for ro in rollouts),
            "sequential_tokens": max(ro.sequential for ro in rollouts),
            "children": sum(len(ro.calls) - 1 for ro in rollouts),
            "wall_s": time.perf_counter() - t0,
        },
    )


def _summary(group_id: str, ro: _Rollout) -> dict[str, Any]:
    return {
        "root": trajectory_id(group_id, ro.index),
        "status": ro.status,
        "reason": ro.reason,
        "calls": len(ro.calls),
        "children": len(ro.calls) - 1,
        "total_tokens": ro.total_tokens,
        "sequential_tokens": ro.sequential,
        "wall_s": ro.wall_s,
    }
