"""Markers and syntax of the trace formats Loom serves. Configuration, not constants: every mode and
reward takes a ``Markers`` / ``SpawnSyntax`` argument and these are only the defaults.

A marker need not be one token of the model's tokenizer (a ChatML/Qwen3 tokenizer has ``<think>`` but
not ``<EOT>``): ``marker_ids`` gives its canonical ids, the ones the modes stop on and insert, and
``encode_with_markers`` encodes a text with every multi-token marker as those ids
(docs/models.md, "Markers with any tokenizer").

Streaming defaults follow StreamingThinker (docs/algorithms.md §1.2); the spawn syntax is APR's Countdown
syntax (docs/algorithms.md §2.4); the reasoning format is ``<think>…</think>`` then ``\\boxed{}``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Markers:
    sentence_end: str = "<EOS>"  # closes each revealed source sentence
    thought_end: str = "<EOT>"  # closes each streaming thought
    reasoning_end: str = "<EOR>"  # closes the deep-reasoning phase
    answer_end: str = "<EOA>"  # closes the answer
    skip: str = "<ignore>"  # a streaming thought that skips this sentence
    think_open: str = "<think>"
    think_close: str = "</think>"
    connector: str = "Now reason step by step, then answer."  # instruction I after the last sentence

    def special_tokens(self) -> list[str]:
        return [
            self.sentence_end,
            self.thought_end,
            self.reasoning_end,
            self.answer_end,
            self.skip,
            self.think_open,
            self.think_close,
        ]


@dataclass(frozen=True)
class SpawnSyntax:
    """APR's Countdown spawn/join syntax; ``{i}`` is the child index, ``{node}`` its node id."""

    spawn_open: str = "<Calling Sub Searches>"
    spawn_child: str = "<Start Sub Search {i} at level 1> Moving to Node #{node}"
    spawn_close: str = "<End Calling Sub Searches>"
    join_open: str = "<Sub Searches Returned>"
    join_child: str = "<Result of Sub Search {i}> {message}"
    join_close: str = "<End Sub Searches Returned>"
    no_solution: str = "No solution"
    tokens: list[str] = field(
        default_factory=lambda: [
            "<Calling Sub Searches>",
            "<End Calling Sub Searches>",
            "<Sub Searches Returned>",
            "<End Sub Searches Returned>",
        ]
    )


DEFAULT_MARKERS = Markers()
DEFAULT_SPAWN = SpawnSyntax()

# The forced ending REA-RL appends to a truncated thinking part (docs/algorithms.md §3).
FORCED_ENDING = "\n</think>\n\n**Final Answer:**\n\n"

# REA-RL reflection keywords (docs/algorithms.md §1.5).
REFLECTION_KEYWORDS: tuple[str, ...] = ("wait", "alternatively", "check", "but")


class MarkerError(ValueError):
    """A marker the tokenizer cannot write: it encodes to nothing or through the unknown token."""


def marker_ids(tokenizer: Any, marker: str) -> list[int]:
    """The canonical ids of ``marker``: the tokenizer's encoding of the marker alone
    (``add_special_tokens=False``). One id where the marker is a token of the vocabulary (an added
    token is split out before any merge, so every encoding of a text writes it so); else the ids its
    text alone encodes to. A mode matches a marker on exactly these ids and inserts exactly these:
    a generation that spells the marker's text with other ids (a BPE split at another boundary)
    has not written the marker. Matching on ids, not on decoded text, keeps a match at a token
    boundary and the completion the concatenation of sampled and inserted ids."""
    ids = [int(i) for i in tokenizer.encode(marker, add_special_tokens=False)]
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids or (unk is not None and unk in ids):
        raise MarkerError(f"the tokenizer cannot write the marker {marker!r} (it encodes to {ids})")
    return ids


def ends_with(ids: list[int], marker: list[int]) -> bool:
    """Do ``ids`` end with the marker's canonical ids?"""
    return len(ids) >= len(marker) and ids[len(ids) - len(marker) :] == marker


def encode_with_markers(tokenizer: Any, text: str, markers: Iterable[str]) -> list[int]:
    """``text``'s ids with every occurrence of a multi-token marker written as its canonical ids and
    the text between encoded piece by piece. Single-token markers need no split: the tokenizer
    writes an added token as its id wherever it occurs, so the text is encoded whole around them.
    Only the markers ``text`` holds are looked up (``MarkerError`` for one the tokenizer cannot write)."""
    multi = sorted(
        (m for m in set(markers) if m and m in text and len(marker_ids(tokenizer, m)) > 1),
        key=len,
        reverse=True,
    )

    def plain(piece: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(piece, add_special_tokens=False)] if piece else []

    if not multi:
        return plain(text)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(re.escape(m) for m in multi) + ")", text):
        ids += marker_ids(tokenizer, piece) if piece in multi else plain(piece)
    return ids
