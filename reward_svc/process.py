"""Process rewards (docs/interop-reward.md "Process rewards"): a PRM's score for every step.

A trajectory's completion is cut into steps (``lines``: after each line break; ``separator``: after
each occurrence of a separator the PRM was trained with; ``segments``: the trajectory's own segments,
a tree's nodes among them), each step a span of completion tokens [start, end): the cut points are
found in the decoded completion and mapped to the first token boundary that covers them, and a step's
text is the decoding of its own tokens, so the offsets are exact token indices. A trajectory sent
without token ids is cut the same way in its text, its offsets in characters (``unit`` "char").

The PRM is a judge server (``LOOM_REWARD_JUDGES``, asked through ``loom.clients.judge``) asked once
per step prefix with the prompt of ``loom.prm`` (the steps fenced as untrusted data); a step's score is
P(yes) over {yes, no} from the first token's top log-probs, or, for a classification-head PRM that
answers its score as text, that number in [0, 1]. The component's value aggregates the step scores
(min, mean, last or product); a failed request is the trajectory's typed status (``prm_timeout``,
``prm_unavailable``, ``prm_unparsable``) and value 0. Pure, but for the policy tokenizer loaded on
first use: the requests are made by the caller (``reward_svc.core``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from loom.clients.judge import JudgeAsk, JudgeReply
from loom.contracts.rewards import ProcessParams
from loom.contracts.wire import Group, StepScore, Trajectory
from loom.prm import steps_prompt
from reward_svc.context import GroupContext, reads
from reward_svc.judge import LOGPROBS, p_yes, parse_verdict

Decode = Callable[[Sequence[int]], str]
STATUS = {"judge_timeout": "prm_timeout", "judge_unavailable": "prm_unavailable"}


@dataclass(frozen=True)
class Step:
    start: int
    end: int
    text: str
    unit: str = "token"  # token | char


@dataclass
class ProcessVerdict:
    status: str  # ok | invalid | prm_timeout | prm_unparsable | prm_unavailable
    score: float = 0.0
    steps: list[StepScore] = field(default_factory=list)
    detail: str | None = None


@lru_cache(maxsize=1)
def policy_decoder() -> Decode:
    """Decoding with the policy's tokenizer (``LOOM_MODEL``), as the rollout service writes a
    trajectory's text: EOS and pad dropped, other special tokens kept."""
    from transformers import AutoTokenizer

    from loom.contracts.settings import get_settings
    from zoo.registry import resolve_model_path

    tok: Any = AutoTokenizer.from_pretrained(str(resolve_model_path(get_settings().model)))
    drop = {i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None}

    def decode(ids: Sequence[int]) -> str:
        return str(tok.decode([i for i in ids if i not in drop], skip_special_tokens=False))

    return decode


def char_cuts(text: str, params: ProcessParams) -> list[int]:
    """Character offsets where a step ends (after each line break or separator), the end included: a
    blank stretch is no step of its own, and past ``max_steps`` the rest is the last step (so a long
    text costs at most ``max_steps`` token searches)."""
    sep = "\n" if params.steps == "lines" else params.separator or "\n"
    cuts: list[int] = []
    at, prev = text.find(sep), 0
    while at >= 0 and len(cuts) < params.max_steps - 1:
        end = at + len(sep)
        if text[prev:at].strip():
            cuts.append(end)
            prev = end
        at = text.find(sep, end)
    return [*cuts, len(text)]


def token_cut(ids: Sequence[int], decode: Decode, char_at: int) -> int:
    """The fewest leading tokens whose decoding covers ``char_at`` characters (binary search over the
    prefixes: a prefix's decoded length grows with it)."""
    lo, hi = 0, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid])) >= char_at:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _spans(bounds: Sequence[int]) -> list[tuple[int, int]]:
    out, prev = [], 0
    for b in sorted(set(bounds)):
        if b > prev:
            out.append((prev, b))
            prev = b
    return out


def _steps_of_spans(
    spans: Sequence[tuple[int, int]], read: Callable[[int, int], str], unit: str, params: ProcessParams
) -> list[Step]:
    """Steps of the spans: a blank span joins the step before it (or the next one), and past
    ``max_steps`` the last ones are one step; a step's text is its own tokens' (characters')."""
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and (not read(a, b).strip() or len(merged) >= params.max_steps):
            merged[-1][1] = b
        elif merged and not read(*merged[-1]).strip():
            merged[-1][1] = b
        else:
            merged.append([a, b])
    sep = params.separator if params.steps == "separator" else "\n"
    steps = []
    for a, b in merged:
        text = read(a, b)
        text = text[: -len(sep)] if sep and text.endswith(sep) else text
        steps.append(Step(a, b, text.strip("\n"), unit))
    return steps


def split_steps(t: Trajectory, params: ProcessParams, decode: Decode | None) -> list[Step] | str:
    """The trajectory's steps, or why it has none (an ``invalid`` detail)."""
    ids = t.completion_ids
    if ids and decode is not None:
        try:
            decoded = decode(ids)
        except (IndexError, KeyError, OverflowError, TypeError, ValueError) as exc:
            return f"completion ids the policy tokenizer cannot decode ({type(exc).__name__})"
        if params.steps == "segments":
            kinds = params.segment_kinds
            segs = [s for s in t.segments if (s.kind in kinds if kinds else s.kind != "observation")]
            spans = _segment_spans(sorted(segs, key=lambda s: s.start), len(ids))
        else:
            spans = _spans([token_cut(ids, decode, c) for c in char_cuts(decoded, params)])
        steps = _steps_of_spans(spans, lambda a, b: decode(ids[a:b]), "token", params)
    elif params.steps == "segments":
        return "steps='segments' needs the trajectory's token ids"
    elif t.text:
        text = t.text
        steps = _steps_of_spans(_spans(char_cuts(text, params)), lambda a, b: text[a:b], "char", params)
    else:
        return "trajectory has no text"
    return steps or "trajectory has no steps"


def _segment_spans(segs: Sequence[Any], n: int) -> list[tuple[int, int]]:
    """The segments' spans in order (overlaps cut at the previous end); none: the whole completion."""
    out: list[tuple[int, int]] = []
    prev = 0
    for s in segs:
        a, b = max(s.start, prev), min(s.end, n)
        if b > a:
            out.append((a, b))
            prev = b
    return out or ([(0, n)] if n else [])


def plan_asks(
    group: Group, params: ProcessParams, decode: Decode | None
) -> list[list[Step] | ProcessVerdict]:
    """Each trajectory's steps (one PRM request per step: ``asks_of``), or its verdict unasked."""
    out: list[list[Step] | ProcessVerdict] = []
    for t in group.trajectories:
        if t.text is None and not t.completion_ids:
            out.append(ProcessVerdict("invalid", detail="trajectory has no text"))
            continue
        steps = split_steps(t, params, decode)
        out.append(ProcessVerdict("invalid", detail=steps) if isinstance(steps, str) else steps)
    return out


def asks_of(group: Group, steps: Sequence[Step], params: ProcessParams) -> list[JudgeAsk]:
    """One request per step prefix: steps 1..k, the k-th the one judged."""
    texts = [s.text for s in steps]
    question, limits = group.prompt or "", (params.max_step_chars, params.max_prefix_chars)
    t_s = params.timeout_s
    return [
        JudgeAsk(
            params.prm, steps_prompt(params.template, question, texts[: k + 1], *limits), 1, t_s, LOGPROBS
        )
        for k in range(len(texts))
    ]


def step_score(reply: JudgeReply) -> tuple[str, float, str | None]:
    """(status, score, detail) of one step's reply: P(yes) from the top log-probs, else a
    classification head's number (or yes/no) as the completion's text."""
    if reply.status != "ok":
        return STATUS.get(reply.status, "prm_unparsable"), 0.0, reply.detail
    score = p_yes(reply.first_tops)
    if score is None:
        score = parse_verdict(reply.text)
    if score is None:
        return "prm_unparsable", 0.0, f"PRM said {reply.text[:80]!r}: no yes/no, no score in [0, 1]"
    return "ok", min(1.0, max(0.0, score)), None


def aggregate(scores: Sequence[float], how: str) -> float:
    """The component's value from its step scores (docs/interop-reward.md "Process rewards")."""
    if how == "min":
        return min(scores)
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "last":
        return scores[-1]
    return math.prod(scores)


def verdict_of(steps: Sequence[Step], replies: Sequence[JudgeReply], how: str) -> ProcessVerdict:
    """A trajectory's verdict from its steps' replies: the first failed step is its status."""
    scored = []
    for s, reply in zip(steps, replies, strict=True):
        status, score, detail = step_score(reply)
        if status != "ok":
            return ProcessVerdict(status, detail=detail)
        scored.append(StepScore(start=s.start, end=s.end, score=score, unit=s.unit))  # type: ignore[arg-type]
    return ProcessVerdict("ok", aggregate([s.score for s in scored], how), scored)


@reads("process")
def process(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """The aggregated step scores in [0, 1]; 0 when they could not be had (the status says why)."""
    ProcessParams.model_validate(params)
    return ctx.scores("process", "the PRM's step scores")
