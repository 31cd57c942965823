"""Views of one trajectory's text that the reward families share: answer region, thinking part,
streaming segments and token lengths. String operations only, every one linear in the text length.

Lengths are in tokens when the trajectory carries token ids (segment offsets, ``completion_ids``);
text-only callers (OpenRLHF, slime, TRL) get an approximate count (words and punctuation).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from loom.answers import last_boxed
from loom.contracts.rewards import ANSWER_TAIL_CHARS
from loom.contracts.wire import Trajectory
from loom.formats import DEFAULT_MARKERS, Markers

_TOKEN = re.compile(r"\w+|[^\w\s]")


def approx_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def brace_depth(text: str) -> int:
    depth = best = 0
    for c in text:
        if c == "{":
            depth += 1
            best = max(best, depth)
        elif c == "}":
            depth = max(0, depth - 1)
    return best


@dataclass
class Piece:
    """One phase span: its text (None when the caller gave only offsets), tokens, and whether it ends
    with its closing marker."""

    text: str | None
    n_tokens: int
    terminated: bool


@dataclass
class TraceView:
    text: str
    n_tokens: int
    stream: list[Piece] = field(default_factory=list)
    deep: Piece | None = None
    answer: str = ""
    stray_observation: bool = False  # a revealed sentence after the last thought: a thought lost its end
    from_segments: bool = False

    @property
    def stream_tokens(self) -> int:
        return sum(p.n_tokens for p in self.stream)

    @property
    def deep_tokens(self) -> int:
        return self.deep.n_tokens if self.deep else 0


def _strip_end(text: str, marker: str) -> tuple[str, bool]:
    body = text.rstrip()
    if body.endswith(marker):
        return body[: -len(marker)], True
    return text, False


def split_streaming(text: str, m: Markers = DEFAULT_MARKERS) -> TraceView:
    """Split a streaming completion ``C1<EOS> R1<EOT> ... C_T<EOS> R_T<EOT> I R<EOR> answer<EOA>``.

    Observation sentences (up to each piece's last ``<EOS>``) are removed from the thoughts.
    """
    view = TraceView(text=text, n_tokens=approx_tokens(text))
    last = text.rfind(m.thought_end)
    head, rest = (
        (text[: last + len(m.thought_end)], text[last + len(m.thought_end) :]) if last >= 0 else ("", text)
    )
    for raw in head.split(m.thought_end)[:-1]:
        n_obs = raw.count(m.sentence_end)
        thought = raw.rsplit(m.sentence_end, 1)[-1] if n_obs else raw
        # two revealed sentences in one piece: the thought between them never ended with <EOT>
        view.stream.append(Piece(thought, approx_tokens(thought), terminated=n_obs <= 1))
    if m.sentence_end in rest:
        view.stray_observation = True
        rest = rest.rsplit(m.sentence_end, 1)[-1]
    if m.connector and m.connector in rest:
        rest = rest.split(m.connector, 1)[1]
    end = rest.find(m.reasoning_end)
    if end >= 0:
        deep, answer = rest[:end], rest[end + len(m.reasoning_end) :]
        view.deep = Piece(deep, approx_tokens(deep), terminated=True)
    else:
        deep, answer = rest, ""
        view.deep = Piece(deep, approx_tokens(deep), terminated=False) if deep.strip() else None
    view.answer = answer.split(m.answer_end, 1)[0]
    return view


def view_of(traj: Trajectory, m: Markers = DEFAULT_MARKERS) -> TraceView:
    """The trajectory's view: typed segments when the rollout service gave them, else marker split.

    A segment's text is ``segment.meta["text"]`` when present; its length is its token span.
    """
    text = traj.text or ""
    split = split_streaming(text, m)
    n_tokens = len(traj.completion_ids) if traj.completion_ids else split.n_tokens
    stream_segs = sorted((s for s in traj.segments if s.kind == "stream"), key=lambda s: (s.start, s.index))
    deep_segs = [s for s in traj.segments if s.kind == "deep"]
    answer_segs = [s for s in traj.segments if s.kind == "answer"]
    if not stream_segs and not deep_segs:
        split.n_tokens = n_tokens
        return split
    view = TraceView(
        text=text, n_tokens=n_tokens, from_segments=True, stray_observation=split.stray_observation
    )
    aligned = len(split.stream) == len(stream_segs)
    for k, seg in enumerate(stream_segs):
        seg_text = seg.meta.get("text")
        if isinstance(seg_text, str):
            body, ended = _strip_end(seg_text, m.thought_end)
            view.stream.append(Piece(body, seg.end - seg.start, ended))
        elif aligned:
            piece = split.stream[k]
            view.stream.append(Piece(piece.text, seg.end - seg.start, piece.terminated))
        else:
            view.stream.append(Piece(None, seg.end - seg.start, False))
    if deep_segs:
        n_deep = sum(s.end - s.start for s in deep_segs)
        seg_text = "".join(s.meta.get("text", "") for s in deep_segs if isinstance(s.meta.get("text"), str))
        if seg_text:
            body, ended = _strip_end(seg_text, m.reasoning_end)
            view.deep = Piece(body, n_deep, ended)
        elif split.deep is not None:
            view.deep = Piece(split.deep.text, n_deep, split.deep.terminated)
        else:
            view.deep = Piece(None, n_deep, False)
    answer_text = "".join(s.meta.get("text", "") for s in answer_segs if isinstance(s.meta.get("text"), str))
    view.answer = answer_text or split.answer
    return view


def thinking_text(text: str, m: Markers = DEFAULT_MARKERS) -> str:
    """The thinking part: inside ``<think>…</think>`` when present, else everything before the
    closing tag, else the whole text (streaming traces: thoughts plus deep phase)."""
    close = text.find(m.think_close)
    if close >= 0:
        head = text[:close]
        open_ = head.find(m.think_open)
        return head[open_ + len(m.think_open) :] if open_ >= 0 else head
    end = text.find(m.reasoning_end)
    return text[:end] if end >= 0 else text


def answer_region(text: str, tail_chars: int = ANSWER_TAIL_CHARS) -> tuple[str, str]:
    """docs/algorithms.md §1.1: ``("boxed", content)`` of the last balanced boxed answer, else
    ``("tail", last tail_chars characters)``."""
    boxed = last_boxed(text)
    if boxed is not None:
        return "boxed", boxed
    return "tail", text[-tail_chars:]
