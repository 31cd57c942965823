"""Format rewards (docs/algorithms.md §1.2): binary, per trajectory, each returned separately.

- ``format_stream`` R_fmt^s and ``format_deep`` R_fmt^d (AdaSR §3.2, "Format Reward");
- ``format_think``: ``<think>…</think>`` then an answer with ``\\boxed{}``;
- ``format_spawn``: well-formed spawn and join blocks (APR syntax, ``loom.formats.SpawnSyntax``).
"""

from __future__ import annotations

import re
from typing import Any

from loom.answers import last_boxed
from loom.contracts.rewards import NoParams
from loom.formats import DEFAULT_SPAWN, SpawnSyntax
from reward_svc.context import GroupContext
from reward_svc.trace import TraceView


def stream_ok(view: TraceView, skip: str) -> bool:
    """R_fmt^s = 1 iff there is a streaming segment, every one ends with the end-of-thought marker,
    and each content is a non-empty thought or exactly the skip marker."""
    if not view.stream or view.stray_observation:
        return False
    for piece in view.stream:
        if not piece.terminated or piece.text is None:
            return False
        body = piece.text.strip()
        if not body or (skip in body and body != skip):
            return False
    return True


def deep_ok(view: TraceView) -> bool:
    """R_fmt^d = 1 iff the deep phase is non-empty and ends with the end-of-reasoning marker."""
    d = view.deep
    return d is not None and d.terminated and d.text is not None and bool(d.text.strip())


def format_stream(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    NoParams.model_validate(params)
    return [float(stream_ok(v, ctx.markers.skip)) for v in ctx.views]


def format_deep(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    NoParams.model_validate(params)
    return [float(deep_ok(v)) for v in ctx.views]


def think_ok(text: str, open_: str, close: str) -> bool:
    """One ``<think>`` block with non-empty content first, then an answer holding ``\\boxed{}``."""
    if text.count(open_) != 1 or text.count(close) != 1:
        return False
    head, _, answer = text.partition(close)
    before, _, thinking = head.partition(open_)
    return not before.strip() and bool(thinking.strip()) and last_boxed(answer) is not None


def format_think(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    NoParams.model_validate(params)
    m = ctx.markers
    return [float(think_ok(v.text, m.think_open, m.think_close)) for v in ctx.views]


def _template(t: str) -> str:
    return re.escape(t).replace(re.escape("{i}"), r"(\d+)").replace(re.escape("{node}"), r"\S+")


def spawn_ok(text: str, syn: SpawnSyntax = DEFAULT_SPAWN) -> bool:
    """Spawn and join blocks alternate; each spawn block starts children 1..k, and the join block
    that follows returns exactly children 1..k. A trace without blocks is well-formed."""
    child = re.compile(_template(syn.spawn_child))
    # the rendered text has single braces where the template escapes them as {{ and }}
    result = re.compile(_template(syn.join_child.split("{message}")[0].replace("{{", "{").replace("}}", "}")))
    marks = re.compile(
        "|".join(re.escape(t) for t in (syn.spawn_open, syn.spawn_close, syn.join_open, syn.join_close))
    )
    expect = syn.spawn_open
    pending = 0
    last = 0
    nxt = {syn.spawn_open: syn.spawn_close, syn.spawn_close: syn.join_open, syn.join_open: syn.join_close}
    for m in marks.finditer(text):
        tok = m.group(0)
        if tok != expect:
            return False
        body = text[last : m.start()]
        if tok == syn.spawn_close:
            idx = [int(i) for i in child.findall(body)]
            if not idx or idx != list(range(1, len(idx) + 1)):
                return False
            pending = len(idx)
        elif tok == syn.join_close:
            idx = [int(i) for i in result.findall(body)]
            if idx != list(range(1, pending + 1)):
                return False
        last = m.end()
        expect = nxt.get(tok, syn.spawn_open)
    return expect == syn.spawn_open


def format_spawn(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    NoParams.model_validate(params)
    return [float(spawn_ok(v.text)) for v in ctx.views]
