"""Chunking of the thinking part (ALGORITHMS.md 3; REA-RL appendix A), in completion-token offsets.

The thinking part is the text between ``<think>`` (or the start of the completion) and ``</think>``
(or its end). It is split on blank lines; pieces are merged until a chunk has at least
``min_tokens`` tokens and ends with a sentence end, and no chunk grows past ``max_tokens`` (a single
piece longer than that is split at line ends). Every chunk is a token span ``[start, end)`` of the
completion, so a cut is always a token boundary of the policy's own tokens: text is derived.

A separator (the blank line) opens the chunk that follows it, so cutting after chunk ``i`` keeps
``...last sentence.`` without a trailing blank line, exactly where the forced ending goes.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Decode = Callable[[list[int]], str]

BLANK_LINE = re.compile(r"\n[ \t]*\n")
SENTENCE_ENDS = ".!?。！？"
_CLOSERS = " \t\r\n*_$)]}\"'»\\"


@dataclass(frozen=True)
class Chunk:
    start: int  # completion-token offsets [start, end)
    end: int
    text: str

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


@dataclass
class Thinking:
    """The thinking part of one completion and its chunks (all offsets in completion tokens)."""

    start: int
    end: int
    chunks: list[Chunk] = field(default_factory=list)
    line_cuts: list[int] = field(default_factory=list)  # token boundaries at each line end
    closed: bool = False  # the completion closes the thinking part

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


def token_starts(ids: Sequence[int], decode: Decode) -> tuple[str, list[int]]:
    """The decoded text and each token's first character offset in it (plus the text length last).

    The offset of token ``k`` is ``len(decode(ids[:k]))``. Decoding token by token gives it for most
    tokenizers; when it does not (a multi-byte character split over byte-level tokens, a decoder that
    strips the first space), the prefixes are decoded incrementally, in linear time; should that not
    end on the text's length, every prefix is decoded (quadratic, exact by construction).
    """
    ids = list(ids)
    text = decode(ids)
    pieces = [decode([t]) for t in ids]
    if "".join(pieces) == text:
        starts = [0]
        for p in pieces:
            starts.append(starts[-1] + len(p))
        return text, starts
    starts = _incremental_starts(ids, pieces, decode)
    if starts[-1] != len(text):
        starts = [0] + [len(decode(ids[:k])) for k in range(1, len(ids) + 1)]
    return text, starts


def _incremental_starts(ids: list[int], pieces: list[str], decode: Decode) -> list[int]:
    """``len(decode(ids[:k]))`` for every k, decoding short windows only.

    A window runs from the last boundary where the text is final (no later token changes what was
    decoded before it) to token k: final where the window does not end in U+FFFD (an unfinished
    UTF-8 character decodes as one), or where the next token decodes the same alone (a genuine
    U+FFFD, or bytes no continuation can complete). Each window keeps one token of context before
    that boundary, for decoders that treat the first token apart (a stripped leading space).
    """
    starts = [0]
    ctx, base = 0, 0  # the window's first token; token k starts at base + len(decode(ids[ctx:k]))
    ahead: str | None = None  # decode(ids[ctx : k + 1]), when the last step needed it
    for k in range(1, len(ids) + 1):
        window = ahead if ahead is not None else decode(ids[ctx:k])
        ahead = None
        starts.append(base + len(window))
        if k == len(ids):
            break
        if window.endswith("\ufffd"):
            ahead = decode(ids[ctx : k + 1])
            if ahead != window + pieces[k]:
                continue  # token k may complete the character: the boundary is not final yet
            ahead = None
        ctx = k - 1
        base = starts[-1] - len(pieces[ctx])
    return starts


def ends_sentence(text: str) -> bool:
    body = text.rstrip(_CLOSERS)
    return bool(body) and body[-1] in SENTENCE_ENDS


def _round_up(starts: list[int], char: int, lo: int, hi: int) -> int:
    """The first token boundary at or after character ``char``, within tokens [lo, hi]."""
    k = bisect.bisect_left(starts, char, lo, hi + 1)
    return min(max(k, lo), hi)


def _round_down(starts: list[int], char: int, lo: int, hi: int) -> int:
    """The last token boundary at or before character ``char``, within tokens [lo, hi]."""
    k = bisect.bisect_right(starts, char, lo, hi + 1) - 1
    return min(max(k, lo), hi)


def find_thinking(
    ids: Sequence[int],
    decode: Decode,
    *,
    think_open: str = "<think>",
    think_close: str = "</think>",
) -> tuple[Thinking, str, list[int]]:
    """Locate the thinking part: (Thinking without chunks, decoded text, token start offsets)."""
    text, starts = token_starts(ids, decode)
    n = len(ids)
    opened = text.find(think_open)
    c0 = opened + len(think_open) if opened >= 0 else 0
    closed = text.find(think_close, c0)
    c1 = closed if closed >= 0 else len(text)
    t0 = _round_up(starts, c0, 0, n)
    t1 = _round_down(starts, c1, t0, n) if closed >= 0 else n
    return Thinking(start=t0, end=t1, closed=closed >= 0), text, starts


def chunk_thinking(
    ids: Sequence[int],
    decode: Decode,
    *,
    min_tokens: int = 32,
    max_tokens: int = 128,
    think_open: str = "<think>",
    think_close: str = "</think>",
) -> Thinking:
    """Chunks of the thinking part of ``ids`` (REA-RL appendix A with ALGORITHMS.md 3's bounds)."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    thinking, text, starts = find_thinking(ids, decode, think_open=think_open, think_close=think_close)
    t0, t1 = thinking.start, thinking.end
    if t1 <= t0:
        return thinking
    c0, c1 = starts[t0], starts[t1]
    body = text[c0:c1]

    def span_text(a: int, b: int) -> str:
        return text[starts[a] : starts[b]]

    # line-end cuts (for fixed truncation): before each newline, at a token boundary
    cuts = {_round_up(starts, c0 + m.start(), t0, t1) for m in re.finditer("\n", body)}
    thinking.line_cuts = sorted(c for c in cuts if t0 < c < t1)

    # blank-line pieces, as token spans; a separator opens the next piece
    bounds = [t0]
    for m in BLANK_LINE.finditer(body):
        b = _round_up(starts, c0 + m.start(), t0, t1)
        if b > bounds[-1]:
            bounds.append(b)
    if t1 > bounds[-1]:
        bounds.append(t1)
    pieces: list[tuple[int, int]] = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        pieces.extend(_split_long(a, b, max_tokens, thinking.line_cuts))

    chunks: list[Chunk] = []
    cur: tuple[int, int] | None = None
    for a, b in pieces:
        if cur is not None and b - cur[0] > max_tokens:
            chunks.append(Chunk(cur[0], cur[1], span_text(*cur)))
            cur = None
        cur = (a, b) if cur is None else (cur[0], b)
        if cur[1] - cur[0] >= min_tokens and ends_sentence(span_text(*cur)):
            chunks.append(Chunk(cur[0], cur[1], span_text(*cur)))
            cur = None
    if cur is not None:
        chunks.append(Chunk(cur[0], cur[1], span_text(*cur)))
    thinking.chunks = chunks
    return thinking


def _split_long(a: int, b: int, max_tokens: int, line_cuts: list[int]) -> list[tuple[int, int]]:
    """Split a piece longer than ``max_tokens`` at line ends (else every ``max_tokens`` tokens)."""
    out: list[tuple[int, int]] = []
    while b - a > max_tokens:
        lo = bisect.bisect_right(line_cuts, a)
        hi = bisect.bisect_right(line_cuts, a + max_tokens)
        cut = line_cuts[hi - 1] if hi > lo else a + max_tokens
        out.append((a, cut))
        a = cut
    out.append((a, b))
    return out
