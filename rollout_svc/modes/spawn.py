"""spawn (ALGORITHMS.md 2.4; APR): the parent spawns child calls and joins their returned messages.

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
"""

from __future__ import annotations

import asyncio
import re
import string
import time
from dataclasses import dataclass, field
from typing import Any

from loom.formats import DEFAULT_SPAWN, SpawnSyntax
from loom.schemas import FinishReason, Group, RolloutRequest, Segment, ThreadLink, Trajectory
from rollout_svc.engines.base import Engine
from rollout_svc.modes import ModeError, param, sample_seed, trajectory_id


@dataclass
class SpawnConfig:
    syntax: SpawnSyntax = DEFAULT_SPAWN
    child_template: str = "[child] {message}\n"  # the tiny model's child prompt (loom.tiny.child_prompt)
    think_close: str = "</think>"
    max_children: int = 8
    max_depth: int = 1  # the parent is depth 0; children at max_depth may not spawn
    child_max_tokens: int = 256
    max_total_tokens: int = 8192
    max_message_chars: int = 512

    @classmethod
    def from_request(cls, request: RolloutRequest) -> SpawnConfig:
        mp = dict(request.mode_params)
        syntax_keys = {
            "spawn_open",
            "spawn_child",
            "spawn_close",
            "join_open",
            "join_child",
            "join_close",
            "no_solution",
        }
        own = {
            "child_template",
            "think_close",
            "max_children",
            "max_depth",
            "child_max_tokens",
            "max_total_tokens",
            "max_message_chars",
        }
        unknown = sorted(set(mp) - syntax_keys - own)
        if unknown:
            raise ModeError(f"spawn does not know mode_params {unknown}; known: {sorted(syntax_keys | own)}")
        syn = {k: param(mp, k, str, getattr(DEFAULT_SPAWN, k)) for k in syntax_keys}
        syntax = SpawnSyntax(**syn, tokens=list(DEFAULT_SPAWN.tokens))
        child_template = param(mp, "child_template", str, cls.child_template)
        check_template("join_child", syntax.join_child, ("i", "message"))
        check_template("child_template", child_template, ("message",))
        cfg = cls(
            syntax=syntax,
            child_template=child_template,
            think_close=param(mp, "think_close", str, cls.think_close),
            max_children=param(mp, "max_children", int, cls.max_children),
            max_depth=param(mp, "max_depth", int, cls.max_depth),
            child_max_tokens=param(mp, "child_max_tokens", int, cls.child_max_tokens),
            max_total_tokens=param(mp, "max_total_tokens", int, cls.max_total_tokens),
            max_message_chars=param(mp, "max_message_chars", int, cls.max_message_chars),
        )
        if not 1 <= cfg.max_children <= 64 or not 0 <= cfg.max_depth <= 4:
            raise ModeError("spawn limits: 1 <= max_children <= 64, 0 <= max_depth <= 4")
        if cfg.child_max_tokens < 1 or cfg.max_total_tokens < 1:
            raise ModeError("spawn token limits must be >= 1")
        if not 1 <= cfg.max_message_chars <= 100_000:
            raise ModeError("spawn limits: 1 <= max_message_chars <= 100000")
        blank = sorted(k for k in syntax_keys - {"no_solution"} if not syn[k].strip())
        if blank or not cfg.think_close.strip():
            raise ModeError(f"spawn markers must not be blank: {blank or ['think_close']}")
        return cfg


def check_template(name: str, template: str, fields: tuple[str, ...]) -> None:
    """``template`` is filled by ``str.format``: it may hold only bare ``{field}`` placeholders of
    ``fields`` (``{{`` and ``}}`` for literal braces) and must hold ``{message}``; checked here, so a
    bad template is a ModeError at the request, not a crash at the first spawn."""
    allowed = ", ".join(f"{{{f}}}" for f in fields)
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:  # an unmatched brace
        raise ModeError(f"mode_params.{name}: {exc} (write {{{{ and }}}} for literal braces)") from exc
    used = set()
    for _, field_name, spec, conversion in parts:
        if field_name is None:
            continue
        if field_name not in fields or spec or conversion:
            shown = field_name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ModeError(
                f"mode_params.{name} may only use the placeholders {allowed}, got {{{shown}}} "
                "(write {{ and }} for literal braces)"
            )
        used.add(field_name)
    if "message" not in used:
        raise ModeError(f"mode_params.{name} must contain {{message}}")


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
    """The join block appended after a spawn block (the layout of loom.tiny.traces.join_block)."""
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
class _Call:
    id: str
    prompt_ids: list[int]
    depth: int
    parent: str | None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    sequential: int = 0  # tokens on this call's longest dependent chain (own + slowest child per join)


async def spawn(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: SpawnConfig,
) -> Group:
    syntax, sampling = cfg.syntax, request.sampling
    close_id = tokenizer.convert_tokens_to_ids(syntax.spawn_close)
    single = (
        isinstance(close_id, int)
        and close_id != tokenizer.unk_token_id
        and tokenizer.encode(syntax.spawn_close, add_special_tokens=False) == [close_id]
    )

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    async def run_call(ro: _Rollout, call: _Call, max_tokens: int, seed_key: int) -> Trajectory:
        finish: FinishReason = "stop"
        stop_reason: str | int | None = None
        status = "ok"
        rounds, span = 0, 0
        t0 = time.perf_counter()
        while True:
            budget = min(max_tokens - len(call.ids), ro.budget)
            room = engine.room(call.prompt_ids + call.ids)  # a parent after its join may fill the context
            if room is not None:
                budget = min(budget, room)
            if budget <= 0:
                finish = "length"
                break
            params = sampling.model_copy(
                update={
                    "n": 1,
                    "max_tokens": budget,
                    "stop": [] if single else [syntax.spawn_close],
                    "stop_token_ids": [close_id] if single else [],
                    "seed": sample_seed(sampling.seed, seed_key, rounds),
                }
            )
            rounds += 1
            c = (await engine.generate(call.prompt_ids + call.ids, params))[0]
            ro.budget -= len(c.token_ids)
            ro.total_tokens += len(c.token_ids)
            start = len(call.ids)
            call.ids += c.token_ids
            call.logprobs += c.logprobs
            call.mask += [1] * len(c.token_ids)
            call.sequential += len(c.token_ids)
            call.segments.append(Segment(kind="thread", start=start, end=len(call.ids), index=span))
            span += 1
            finish, stop_reason = c.finish_reason, c.stop_reason
            if ro.status != "ok":
                break
            text = tokenizer.decode(call.ids, skip_special_tokens=False)
            spawned = c.finish_reason == "stop" and c.stop_reason in (close_id, syntax.spawn_close)
            if not spawned:
                after_join = text.rsplit(syntax.join_close, 1)[-1]
                if (
                    c.finish_reason == "stop" and syntax.spawn_open in after_join
                ):  # a cut by length is no format error
                    ro.fail("unclosed spawn block")
                    finish, status = "abort", "format_error"
                break
            parsed = parse_spawn_block(text, syntax, cfg.max_children, cfg.max_message_chars)
            if isinstance(parsed, SpawnFormatError) or call.depth >= cfg.max_depth:
                ro.fail(
                    parsed.reason
                    if isinstance(parsed, SpawnFormatError)
                    else f"spawn at depth {call.depth} exceeds max_depth {cfg.max_depth}"
                )
                finish, status = "abort", "format_error"
                break
            per_child = min(cfg.child_max_tokens, max(1, ro.budget // len(parsed)))
            children = [
                _Call(
                    f"{call.id}.s{span - 1}c{ch.index}",
                    encode(cfg.child_template.format(message=ch.message)),
                    call.depth + 1,
                    call.id,
                )
                for ch in parsed
            ]
            results = await asyncio.gather(
                *(
                    run_call(ro, ch, per_child, seed_key * 131 + 7 * span + k + 1)
                    for k, ch in enumerate(children)
                )
            )
            messages = []
            for ch, res in zip(children, results, strict=True):
                msg = child_message(
                    tokenizer.decode(res.completion_ids, skip_special_tokens=True),
                    cfg.think_close,
                    syntax.no_solution,
                )
                messages.append(msg)
                ro.links.append(ThreadLink(parent=call.id, child=ch.id, message=msg))
            call.sequential += max(ch.sequential for ch in children)
            if ro.status != "ok":
                break
            join = encode(join_text(messages, syntax))
            start = len(call.ids)
            call.ids += join
            call.logprobs += [0.0] * len(join)
            call.mask += [0] * len(join)
            call.segments.append(
                Segment(
                    kind="observation",
                    start=start,
                    end=len(call.ids),
                    index=span,
                    meta={"join": [ch.id for ch in children]},
                )
            )
        traj = Trajectory(
            id=call.id,
            group_id=group_id,
            prompt_ids=call.prompt_ids,
            completion_ids=call.ids,
            logprobs=call.logprobs,
            logprobs_kind=engine.logprobs_kind,
            loss_mask=call.mask,
            segments=call.segments,
            finish_reason=finish,
            stop_reason=stop_reason,
            policy_version=engine.policy_version,
            engine=engine.name,
            timing={"generate_s": time.perf_counter() - t0},
            parent_id=call.parent,
            meta={
                "depth": call.depth,
                "root": trajectory_id(group_id, ro.index),
                "status": status,
                "sequential_tokens": call.sequential,
            },
        )
        ro.calls.append(traj)
        return traj

    async def rollout(r: int) -> _Rollout:
        ro = _Rollout(r, cfg.max_total_tokens)
        t0 = time.perf_counter()
        root = _Call(trajectory_id(group_id, r), list(prompt_ids), 0, None)
        await run_call(ro, root, sampling.max_tokens, r)
        ro.wall_s = time.perf_counter() - t0
        ro.sequential = root.sequential
        if ro.status != "ok":
            for t in ro.calls:
                t.meta["rollout_status"] = ro.status
        return ro

    t0 = time.perf_counter()
    rollouts = await asyncio.gather(*(rollout(r) for r in range(sampling.n)))
    trajectories, links, summary = [], [], []
    for ro in rollouts:
        ro.calls.sort(key=lambda t: (t.meta["depth"], t.id))
        trajectories += ro.calls
        links += ro.links
        summary.append(
            {
                "root": trajectory_id(group_id, ro.index),
                "status": ro.status,
                "reason": ro.reason,
                "calls": len(ro.calls),
                "children": len(ro.calls) - 1,
                "total_tokens": ro.total_tokens,
                "sequential_tokens": ro.sequential,
                "wall_s": ro.wall_s,
            }
        )
    return Group(
        id=group_id,
        mode="spawn",
        prompt=request.prompt,
        label=request.label,
        task=request.task,
        trajectories=trajectories,
        threads=links,
        meta={
            "rollouts": summary,
            "total_tokens": sum(ro.total_tokens for ro in rollouts),
            "sequential_tokens": max(ro.sequential for ro in rollouts),
            "children": sum(len(ro.calls) - 1 for ro in rollouts),
            "wall_s": time.perf_counter() - t0,
        },
    )


async def run(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    settings: Any = None,
) -> Group:
    """The dispatch entry: config from ``mode_params`` (``settings``: unused; the modes' one signature)."""
    return await spawn(request, prompt_ids, group_id, engine, tokenizer, SpawnConfig.from_request(request))
