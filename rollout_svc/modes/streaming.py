"""streaming (docs/algorithms.md §2.2; AdaSR, StreamingThinker): think while the input arrives.

Loop over the context sentences C_1..C_T: reveal C_t (observation tokens, loss mask 0), decode a
thought until ``<EOT>`` or the skip marker, at most ``segment_cap`` tokens (a capped or skipped thought
is closed with a forced ``<EOT>``, loss mask 0); after C_T append the connector I, decode the deep phase
until ``<EOR>``, then the answer until ``<EOA>`` / EOS.

Layouts:
- ``interleaved`` (default, every engine): [Q, C1, R1, ..., C_T, R_T, I, deep, answer] under a plain
  causal mask; each round resends the whole prefix and the engine's prefix cache makes it cost only
  the new tokens.
- ``group_positions`` (StreamingThinker; torch engine only): source tokens (Q, C_t, I) are group 0,
  model tokens group 1, positions numbered per group, source never sees target
  (``engines.base.Layout``). ``meta["completion_groups"]`` records the groups for the learner.

Latency (AdaSR appendix F): sentence t arrives when a reader at ``reading_wpm`` words per minute has
read C_1..C_t; round t starts at max(arrival_t, end of round t-1) and lasts its measured generation
time. ``timing["latency_s"]`` is the delay from the last sentence's arrival to the first answer token;
``meta["latency_tokens"]`` counts the tokens decoded in that window (engine-independent).

Markers with any tokenizer (docs/models.md): each marker is its canonical ids
(``loom.formats.marker_ids``). A one-token marker is a stop token id (every engine); a marker of
several tokens is a stop id sequence (``stop_token_sequences``, the ``stop_sequences`` capability:
the torch engine), matched when the generated ids end with exactly its canonical ids. A forced marker
and the revealed sentences' ``<EOS>`` are inserted as those ids; the history is never re-tokenized.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from loom.contracts.modes import StreamingParams
from loom.contracts.wire import FinishReason, Group, RolloutRequest, Segment, SegmentKind, Trajectory
from loom.formats import DEFAULT_MARKERS, MarkerError, encode_with_markers, ends_with, marker_ids
from rollout_svc.engines.base import Completion, Engine, Layout
from rollout_svc.modes import ModeError, group_of, sample_seed, trajectory_id

SOURCE, TARGET = 0, 1


@dataclass
class _Sequence:
    """The growing token sequence of one trajectory and everything aligned to its completion."""

    prompt_len: int
    ids: list[int]
    groups: list[int]
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    @property
    def offset(self) -> int:
        return len(self.ids) - self.prompt_len

    def observe(self, ids: list[int], index: int, meta: dict[str, Any] | None = None) -> None:
        start = self.offset
        self._append(ids, SOURCE, [0.0] * len(ids), 0)
        self.segments.append(
            Segment(kind="observation", start=start, end=self.offset, index=index, meta=meta or {})
        )

    def generated(self, c: Completion, kind: SegmentKind, index: int, forced: list[int], meta: dict) -> None:
        start = self.offset
        self._append(c.token_ids, TARGET, c.logprobs, 1)
        if forced:
            self._append(forced, TARGET, [0.0] * len(forced), 0)
        meta = {**meta, "finish_reason": c.finish_reason, "forced_end": bool(forced)}
        self.segments.append(Segment(kind=kind, start=start, end=self.offset, index=index, meta=meta))

    def _append(self, ids: list[int], group: int, logprobs: list[float], mask: int) -> None:
        self.ids += ids
        self.groups += [group] * len(ids)
        self.logprobs += logprobs
        self.mask += [mask] * len(ids)


def _matched(c: Completion, marker: list[int]) -> bool:
    """Did ``c`` stop on ``marker`` (its generated ids end with the marker's canonical ids)?"""
    return c.finish_reason == "stop" and ends_with(c.token_ids, marker)


def _ended_by_eos(c: Completion, markers: list[list[int]]) -> bool:
    return c.finish_reason == "stop" and not any(_matched(c, m) for m in markers)


@dataclass(frozen=True)
class _Plan:
    """What every sample of one group shares: the encoded observations and connector, the markers'
    token ids, and each sentence's arrival time at the reading speed (AdaSR appendix F)."""

    observations: list[list[int]]
    connector: list[int]
    arrivals: list[float]
    eot: list[int]
    skip: list[int]
    eor: list[int]
    eoa: list[int]

    @property
    def multi_token(self) -> list[list[int]]:
        return [m for m in (self.eot, self.skip, self.eor, self.eoa) if len(m) > 1]


def _plan(tokenizer: Any, cfg: StreamingParams) -> _Plan:
    try:
        return _encoded(tokenizer, cfg)
    except MarkerError as exc:
        raise ModeError(f"streaming: {exc}") from None


def _encoded(tokenizer: Any, cfg: StreamingParams) -> _Plan:
    m = DEFAULT_MARKERS
    eot, skip, eor, eoa = (
        marker_ids(tokenizer, x) for x in (m.thought_end, m.skip, m.reasoning_end, m.answer_end)
    )

    def encode(text: str) -> list[int]:
        return encode_with_markers(tokenizer, text, m.special_tokens())

    observations = [encode(f"{cfg.sentence_prefix}{s}{m.sentence_end}") for s in cfg.sentences]
    connector = encode(cfg.connector)
    words = [len(s.split()) for s in cfg.sentences]
    arrivals = [60.0 * sum(words[: t + 1]) / cfg.reading_wpm for t in range(len(words))]
    return _Plan(observations, connector, arrivals, eot, skip, eor, eoa)


class _Sample:
    """One trajectory of a streaming group, grown phase by phase: the stream (a thought after each
    sentence), the deep phase after the connector, the answer; any phase may end the sample early."""

    def __init__(
        self,
        i: int,
        prompt_ids: list[int],
        engine: Engine,
        request: RolloutRequest,
        cfg: StreamingParams,
        plan: _Plan,
    ) -> None:
        self.i, self.prompt_ids, self.engine, self.cfg, self.plan = i, prompt_ids, engine, cfg, plan
        self.sampling = request.sampling
        self.seq = _Sequence(len(prompt_ids), list(prompt_ids), [SOURCE] * len(prompt_ids))
        self.clock, self.gen_s, self.latency_tokens = 0.0, 0.0, 0
        self.finish: FinishReason = "stop"
        self.ended: str | None = None
        self.answer_at: float | None = None

    async def run(self, group_id: str) -> Trajectory:
        await self.stream()
        if self.ended is None:
            await self.deep()
        if self.ended is None:
            await self.answer()
        return self.trajectory(group_id)

    async def stream(self) -> None:
        """Reveal C_t, decode a thought until <EOT> or the skip marker (capped or skipped: a forced <EOT>)."""
        plan = self.plan
        stops = [plan.eot, plan.skip]
        for t, obs in enumerate(plan.observations):
            if self.full_with(obs, SOURCE):
                self.end_at_context()
                return
            self.seq.observe(obs, t)
            c, dt = await self.step(stops, self.cfg.segment_cap, t)
            self.clock = max(self.clock, plan.arrivals[t]) + dt
            self.gen_s += dt
            if t == len(plan.observations) - 1:
                self.latency_tokens += len(c.token_ids)
            eos = _ended_by_eos(c, stops)
            skipped = _matched(c, plan.skip)
            needed = not eos and (c.finish_reason == "length" or skipped)
            forced = self.force(c, plan.eot, needed)
            self.seq.generated(c, "stream", t, forced or [], {"skipped": skipped})
            if eos:
                self.ended = "stream"
                return
            if forced is None:
                self.end_at_context()
                return

    async def deep(self) -> None:
        """After C_T: the connector I, then the deep phase until <EOR> (capped: a forced <EOR>)."""
        plan, n = self.plan, len(self.plan.observations)
        if self.full_with(plan.connector, SOURCE):
            self.end_at_context()
            return
        self.seq.observe(plan.connector, n, {"connector": True})
        c, dt = await self.step([plan.eor], self.cfg.deep_max_tokens, n)
        self.clock = max(self.clock, plan.arrivals[-1]) + dt
        self.gen_s += dt
        self.latency_tokens += len(c.token_ids)
        eos = _ended_by_eos(c, [plan.eor])
        forced = self.force(c, plan.eor, c.finish_reason == "length")
        self.seq.generated(c, "deep", 0, forced or [], {})
        if eos:
            self.ended = "deep"
        elif forced is None:
            self.end_at_context()

    async def answer(self) -> None:
        c, dt = await self.step([self.plan.eoa], self.cfg.answer_max_tokens, len(self.plan.observations) + 1)
        self.gen_s += dt
        self.answer_at = self.clock + dt / max(1, len(c.token_ids))  # first answer token
        self.latency_tokens += 1
        self.seq.generated(c, "answer", 0, [], {})
        self.finish = c.finish_reason

    def end_at_context(self) -> None:
        self.finish, self.ended = "length", "context"

    def layout_of(self, groups: list[int]) -> Layout | None:
        return Layout(groups=groups, gen_group=TARGET) if self.cfg.layout == "group_positions" else None

    def full_with(self, extra: list[int], group: int) -> bool:
        """Would ``extra`` (of ``group``) leave the context no room for a generated token? Nothing
        is appended past the context: the sample ends there with finish_reason "length"."""
        seq = self.seq
        return self.engine.room(seq.ids + extra, self.layout_of(seq.groups + [group] * len(extra))) == 0

    async def step(self, stops: list[list[int]], max_tokens: int, round_: int) -> tuple[Completion, float]:
        """Decode until one of the markers ``stops``: a one-token marker is a stop id, a longer one
        a stop id sequence (exact on its canonical ids)."""
        params = self.sampling.model_copy(
            update={
                "n": 1,
                "max_tokens": max_tokens,
                "stop": [],
                "stop_token_ids": [m[0] for m in stops if len(m) == 1],
                "stop_token_sequences": [m for m in stops if len(m) > 1],
                "seed": sample_seed(self.sampling.seed, self.i, round_),
            }
        )
        t0 = time.perf_counter()
        c = (await self.engine.generate(self.seq.ids, params, self.layout_of(list(self.seq.groups))))[0]
        return c, time.perf_counter() - t0

    def force(self, c: Completion, marker: list[int], needed: bool) -> list[int] | None:
        """The forced end marker's canonical ids after ``c`` ([] when none is needed), None when
        ``c`` and the marker would leave the context no room for a later round (the sample ends
        after ``c``)."""
        forced = list(marker) if needed else []
        if self.full_with(list(c.token_ids) + forced, TARGET):
            return None
        return forced

    def trajectory(self, group_id: str) -> Trajectory:
        seq, cfg, arrivals, n_prompt = self.seq, self.cfg, self.plan.arrivals, len(self.prompt_ids)
        timing = {"generate_s": self.gen_s, "reading_s": arrivals[-1]}
        if self.answer_at is not None:
            timing["latency_s"] = max(0.0, self.answer_at - arrivals[-1])
        meta: dict[str, Any] = {
            "layout": cfg.layout,
            "latency_tokens": self.latency_tokens,
            "reading_wpm": cfg.reading_wpm,
        }
        if self.ended:
            meta["ended_early"] = self.ended
        if cfg.layout == "group_positions":
            meta["completion_groups"] = seq.groups[n_prompt:]
        return Trajectory(
            id=trajectory_id(group_id, self.i),
            group_id=group_id,
            prompt_ids=list(self.prompt_ids),
            completion_ids=seq.ids[n_prompt:],
            logprobs=seq.logprobs,
            logprobs_kind=self.engine.logprobs_kind,
            loss_mask=seq.mask,
            segments=seq.segments,
            finish_reason=self.finish,
            policy_version=self.engine.policy_version,
            engine=self.engine.name,
            timing=timing,
            meta=meta,
        )


# what streaming() takes beyond (request, prompt_ids, group_id, engine), in its order
# (rollout_svc.modes.PROVIDERS gives each)
NEEDS = ("tokenizer", "params")


async def streaming(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: StreamingParams,
) -> Group:
    if cfg.layout == "group_positions":
        engine.require("group_positions", "use mode_params.layout='interleaved' on this engine")
    plan = _plan(tokenizer, cfg)
    if plan.multi_token:
        engine.require("stop_sequences", "a streaming marker of several tokens needs the torch engine")
    samples = [_Sample(i, prompt_ids, engine, request, cfg, plan) for i in range(request.sampling.n)]
    trajectories = await asyncio.gather(*(s.run(group_id) for s in samples))
    return group_of(
        request,
        group_id,
        "streaming",
        list(trajectories),
        meta={"layout": cfg.layout, "n_sentences": len(cfg.sentences)},
    )
