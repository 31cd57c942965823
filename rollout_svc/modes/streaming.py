"""streaming (ALGORITHMS.md 2.2; AdaSR, StreamingThinker): think while the input arrives.

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
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from loom.formats import DEFAULT_MARKERS, Markers
from loom.schemas import Group, RolloutRequest, Segment, SegmentKind, Trajectory
from rollout_svc.engines.base import Completion, Engine, Layout
from rollout_svc.modes import ModeError, param, sample_seed, trajectory_id

SOURCE, TARGET = 0, 1
MAX_TOKENS = 131072  # SamplingParams.max_tokens' bound
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text.strip()) if s.strip()]


@dataclass
class StreamingConfig:
    sentences: list[str]
    layout: Literal["interleaved", "group_positions"] = "interleaved"
    segment_cap: int = 512
    deep_max_tokens: int = 256
    answer_max_tokens: int = 64
    reading_wpm: float = 150.0
    sentence_prefix: str = " "
    connector: str = " " + DEFAULT_MARKERS.connector
    markers: Markers = DEFAULT_MARKERS

    @classmethod
    def from_request(cls, request: RolloutRequest, segment_cap: int = 512, reading_wpm: float = 150.0) -> Any:
        mp = request.mode_params
        known = {
            "sentences",
            "context",
            "layout",
            "segment_cap",
            "deep_max_tokens",
            "answer_max_tokens",
            "reading_wpm",
            "sentence_prefix",
            "connector",
        }
        unknown = sorted(set(mp) - known)
        if unknown:
            raise ModeError(f"streaming does not know mode_params {unknown}; known: {sorted(known)}")
        if "sentences" in mp:
            sentences = mp["sentences"]
            if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
                raise ModeError("mode_params.sentences must be a list of strings")
        elif "context" in mp:
            sentences = split_sentences(param(mp, "context", str, ""))
        else:
            raise ModeError("streaming needs mode_params.sentences (list) or mode_params.context (text)")
        if not sentences:
            raise ModeError("streaming needs at least one sentence")
        if len(sentences) > 1024:
            raise ModeError("streaming takes at most 1024 sentences")
        layout = param(mp, "layout", str, "interleaved")
        if layout not in ("interleaved", "group_positions"):
            raise ModeError(f"mode_params.layout must be 'interleaved' or 'group_positions', got {layout!r}")
        cap = param(mp, "segment_cap", int, segment_cap)
        if not 1 <= cap <= 8192:
            raise ModeError("mode_params.segment_cap must be in [1, 8192]")
        budgets = {
            "deep_max_tokens": param(mp, "deep_max_tokens", int, request.sampling.max_tokens),
            "answer_max_tokens": param(mp, "answer_max_tokens", int, 64),
        }
        for name, value in budgets.items():
            if not 1 <= value <= MAX_TOKENS:
                raise ModeError(f"mode_params.{name} must be in [1, {MAX_TOKENS}], got {value}")
        wpm = param(mp, "reading_wpm", float, reading_wpm)
        if not (math.isfinite(wpm) and wpm > 0):  # sentence arrival times divide by it
            raise ModeError(f"mode_params.reading_wpm must be a finite number > 0, got {wpm}")
        return cls(
            sentences=[str(s) for s in sentences],
            layout=layout,
            segment_cap=cap,
            deep_max_tokens=budgets["deep_max_tokens"],
            answer_max_tokens=budgets["answer_max_tokens"],
            reading_wpm=wpm,
            sentence_prefix=param(mp, "sentence_prefix", str, " "),
            connector=param(mp, "connector", str, " " + DEFAULT_MARKERS.connector),
        )


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


def _marker_id(tokenizer: Any, marker: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(marker)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ModeError(f"streaming needs {marker!r} to be one token of the model's tokenizer")
    return int(tid)


def _ended_by_eos(c: Completion, stop_ids: list[int]) -> bool:
    return c.finish_reason == "stop" and c.stop_reason not in stop_ids


async def streaming(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: StreamingConfig,
) -> Group:
    if cfg.layout == "group_positions":
        engine.require("group_positions", "use mode_params.layout='interleaved' on this engine")
    m = cfg.markers
    eot, skip, eor, eoa = (
        _marker_id(tokenizer, x) for x in (m.thought_end, m.skip, m.reasoning_end, m.answer_end)
    )

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    observations = [encode(f"{cfg.sentence_prefix}{s}{m.sentence_end}") for s in cfg.sentences]
    connector = encode(cfg.connector)
    words = [len(s.split()) for s in cfg.sentences]
    arrivals = [60.0 * sum(words[: t + 1]) / cfg.reading_wpm for t in range(len(words))]
    sampling = request.sampling

    async def one(i: int) -> Trajectory:
        seq = _Sequence(len(prompt_ids), list(prompt_ids), [SOURCE] * len(prompt_ids))
        clock, gen_s, latency_tokens = 0.0, 0.0, 0

        def layout_of(groups: list[int]) -> Layout | None:
            return Layout(groups=groups, gen_group=TARGET) if cfg.layout == "group_positions" else None

        def full_with(extra: list[int], group: int) -> bool:
            """Would ``extra`` (of ``group``) leave the context no room for a generated token? Nothing
            is appended past the context: the sample ends there with finish_reason "length"."""
            return engine.room(seq.ids + extra, layout_of(seq.groups + [group] * len(extra))) == 0

        async def step(stop_ids: list[int], max_tokens: int, round_: int) -> tuple[Completion, float]:
            params = sampling.model_copy(
                update={
                    "n": 1,
                    "max_tokens": max_tokens,
                    "stop": [],
                    "stop_token_ids": stop_ids,
                    "seed": sample_seed(sampling.seed, i, round_),
                }
            )
            t0 = time.perf_counter()
            c = (await engine.generate(seq.ids, params, layout_of(list(seq.groups))))[0]
            return c, time.perf_counter() - t0

        def force(c: Completion, marker: int, needed: bool) -> list[int] | None:
            """The forced end marker after ``c`` ([] when none is needed), None when ``c`` and the
            marker would leave the context no room for a later round (the sample ends after ``c``)."""
            marker_ids = [marker] if needed else []
            if full_with(list(c.token_ids) + marker_ids, TARGET):
                return None
            return marker_ids

        finish: Literal["stop", "length"] = "stop"
        ended = None
        for t, obs in enumerate(observations):
            if full_with(obs, SOURCE):
                finish, ended = "length", "context"
                break
            seq.observe(obs, t)
            c, dt = await step([eot, skip], cfg.segment_cap, t)
            clock = max(clock, arrivals[t]) + dt
            gen_s += dt
            if t == len(observations) - 1:
                latency_tokens += len(c.token_ids)
            eos = _ended_by_eos(c, [eot, skip])
            forced = force(c, eot, not eos and (c.finish_reason == "length" or c.stop_reason == skip))
            seq.generated(c, "stream", t, forced or [], {"skipped": c.stop_reason == skip})
            if eos:
                ended = "stream"
                break
            if forced is None:
                finish, ended = "length", "context"
                break
        answer_at = None
        if ended is None:
            if full_with(connector, SOURCE):
                finish, ended = "length", "context"
            else:
                seq.observe(connector, len(observations), {"connector": True})
                c, dt = await step([eor], cfg.deep_max_tokens, len(observations))
                clock = max(clock, arrivals[-1]) + dt
                gen_s += dt
                latency_tokens += len(c.token_ids)
                eos = _ended_by_eos(c, [eor])
                forced = force(c, eor, c.finish_reason == "length")
                seq.generated(c, "deep", 0, forced or [], {})
                if eos:
                    ended = "deep"
                elif forced is None:
                    finish, ended = "length", "context"
        if ended is None:
            c, dt = await step([eoa], cfg.answer_max_tokens, len(observations) + 1)
            gen_s += dt
            answer_at = clock + dt / max(1, len(c.token_ids))  # first answer token
            latency_tokens += 1
            seq.generated(c, "answer", 0, [], {})
            finish = c.finish_reason
        timing = {"generate_s": gen_s, "reading_s": arrivals[-1]}
        if answer_at is not None:
            timing["latency_s"] = max(0.0, answer_at - arrivals[-1])
        meta: dict[str, Any] = {
            "layout": cfg.layout,
            "latency_tokens": latency_tokens,
            "reading_wpm": cfg.reading_wpm,
        }
        if ended:
            meta["ended_early"] = ended
        if cfg.layout == "group_positions":
            meta["completion_groups"] = seq.groups[len(prompt_ids) :]
        return Trajectory(
            id=trajectory_id(group_id, i),
            group_id=group_id,
            prompt_ids=list(prompt_ids),
            completion_ids=seq.ids[len(prompt_ids) :],
            logprobs=seq.logprobs,
            logprobs_kind=engine.logprobs_kind,
            loss_mask=seq.mask,
            segments=seq.segments,
            finish_reason=finish,
            policy_version=engine.policy_version,
            engine=engine.name,
            timing=timing,
            meta=meta,
        )

    trajectories = await asyncio.gather(*(one(i) for i in range(sampling.n)))
    return Group(
        id=group_id,
        mode="streaming",
        prompt=request.prompt,
        label=request.label,
        task=request.task,
        trajectories=list(trajectories),
        meta={"layout": cfg.layout, "n_sentences": len(cfg.sentences)},
    )
