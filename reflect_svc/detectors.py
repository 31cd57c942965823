"""Detectors: where the overthinking starts (docs/algorithms.md §3; REA-RL §3.1, §5.3, appendix A).

Every detector returns a ``Detection``: the completion-token offset where the kept prefix ends
(``cut``) and, when it is a chunk end, the index of the last kept chunk. Pure functions over a
``Thinking``; what needs a service (the verifier for ``gold``, the reflection model for ``model``)
arrives as plain data: the verdict per chunk, the model's text and top log-probs.

- ``gold``: keep up to the first chunk that states the gold answer (math-verify / exact verifier);
- ``model``: a reflection model labels every chunk Think/Result in one call ("[i]. Think/Result");
  normal = first Result (P >= 0.5), weak = second Result, strong = first chunk with P >= 0.25
  (else normal), P(Result) from the top log-probs of the label token;
- ``heuristic``: cut before the chunk holding the k-th reflection (a baseline);
- ``fixed``: keep a fixed fraction of the thinking tokens, cut at the nearest line end (REA-RL §3.2).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from reflect_svc.chunking import Chunk, Thinking


@dataclass(frozen=True)
class Detection:
    cut: int | None  # completion-token offset where the kept prefix ends; None = nothing detected
    chunk: int | None = None  # last kept chunk, when the cut is a chunk end
    status: str = "truncated"  # a ReflectStatus: truncated (a cut was found) or why not
    detail: str | None = None
    probs: list[float] | None = None  # model: P(Result) per chunk


def _at_chunk(thinking: Thinking, i: int, probs: list[float] | None = None) -> Detection:
    return Detection(cut=thinking.chunks[i].end, chunk=i, probs=probs)


def detect_gold(thinking: Thinking, matches: Sequence[bool]) -> Detection:
    """The first chunk whose stated answer verifies against the gold answer."""
    if len(matches) != len(thinking.chunks):
        raise ValueError(f"{len(matches)} verdicts for {len(thinking.chunks)} chunks")
    for i, ok in enumerate(matches):
        if ok:
            return _at_chunk(thinking, i)
    return Detection(cut=None, status="no_detection", detail="no chunk states the gold answer")


# --------------------------------------------------------------------------------------- heuristic


def reflection_starts(text: str, keywords: Sequence[str], gap_chars: int = 59) -> list[int]:
    """Character offsets of each reflection: a keyword (whole word, any case); a run of keywords
    each within ``gap_chars`` characters of the previous counts once (REA-RL eq. 3's counting).
    Blank keywords are ignored: they would match at every word boundary."""
    words = [k for k in keywords if k.strip()]
    if not words:
        return []
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(k) for k in words) + r")\b", re.IGNORECASE)
    starts: list[int] = []
    last_end = -(10**9)
    for m in pattern.finditer(text):
        if m.start() - last_end > gap_chars:
            starts.append(m.start())
        last_end = m.end()
    return starts


def detect_heuristic(thinking: Thinking, k: int, keywords: Sequence[str], gap_chars: int = 59) -> Detection:
    """Cut before the chunk that holds the k-th reflection (1-based)."""
    chunks = thinking.chunks
    text = "".join(c.text for c in chunks)
    starts = reflection_starts(text, keywords, gap_chars)
    if len(starts) < k:
        return Detection(cut=None, status="no_detection", detail=f"{len(starts)} reflections, k={k}")
    char = starts[k - 1]
    offset = 0
    for i, c in enumerate(chunks):
        offset += len(c.text)
        if char < offset:
            return Detection(cut=c.start, chunk=i - 1 if i > 0 else None)
    return Detection(cut=None, status="no_detection")


# --------------------------------------------------------------------------------------- fixed


def detect_fixed(thinking: Thinking, keep: float) -> Detection:
    """Keep ``keep`` of the thinking tokens, cut at the line end nearest to that point (REA-RL §3.2)."""
    target = thinking.start + keep * thinking.n_tokens
    if keep >= 1.0 or thinking.n_tokens == 0:
        return Detection(cut=None, status="nothing_to_remove")
    cands = thinking.line_cuts or [round(target)]
    cut = min(cands, key=lambda c: (abs(c - target), c))
    return Detection(cut=cut)


# --------------------------------------------------------------------------------------- model

MODEL_INSTRUCTION = (
    "You are provided with a math Question and a model-generated Response. The response is divided "
    "into {n} parts. For each part, analyze it and classify it based on its relationship to the "
    "provided context. For each part, assign one of the following labels:\n"
    "- Think: The part represents the reasoning process that leads to the answer.\n"
    "- Result: The part is the answer provided by the model, where the model may provide the answer in "
    "the middle of its response.\n"
    "For each of the {n} parts, please reply in format:\n"
    "[1]. Think/Result\n[2]. Think/Result\n...\n"
)


def model_prompt(question: str, chunks: Sequence[Chunk]) -> str:
    """REA-RL's SFT prompt for the reflection model (appendix A), chunks numbered ``[i].``."""
    parts = "\n\n".join(f"[{i}]. {c.text.strip()}" for i, c in enumerate(chunks, start=1))
    return (
        f"Question: {question.strip()}\n\nResponse: {parts}\n\n"
        + MODEL_INSTRUCTION.format(n=len(chunks))
        + "\n"
    )


_LABEL = re.compile(r"\[\s*(\d+)\s*\]\s*\.?\s*(Think|Result)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Label:
    index: int  # 1-based, as written
    result: bool
    char: int  # offset of the label word in the model's text


def parse_labels(text: str, n: int) -> list[Label] | None:
    """Exactly ``n`` labels numbered 1..n in order; None for anything else (wrong count, garbage)."""
    labels = [
        Label(int(m.group(1)), m.group(2).lower() == "result", m.start(2)) for m in _LABEL.finditer(text)
    ]
    if len(labels) != n or [lab.index for lab in labels] != list(range(1, n + 1)):
        return None
    return labels


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_BYTE_OF = _bytes_to_unicode()


def token_text(token: str) -> str:
    """A token as text: byte-level BPE spellings (``Ġ``, ``Ċ``) are mapped back to bytes; tokens
    already in text form (vLLM's) are returned as they are."""
    if token and any(ch in ("Ġ", "Ċ") for ch in token) and all(ch in _BYTE_OF for ch in token):
        return bytes(_BYTE_OF[ch] for ch in token).decode("utf-8", errors="replace")
    return token


def _label_mass(top: dict[str, float], word: str) -> float:
    total = 0.0
    for tok, lp in top.items():
        t = token_text(tok).strip().lower()
        if t and word.startswith(t) and math.isfinite(lp):
            total += math.exp(lp)
    return total


def result_probs(
    labels: Sequence[Label], tokens: Sequence[str] | None, tops: Sequence[dict[str, float] | None] | None
) -> list[float]:
    """P(Result) per label from the top log-probs at its label token; the label itself (1 or 0)
    where log-probs are missing or hold neither word. ``tokens`` are the model's output tokens;
    their texts are concatenated to find which token holds each label word."""
    probs = [1.0 if lab.result else 0.0 for lab in labels]
    if not tokens or not tops or len(tokens) != len(tops):
        return probs
    offsets = [0]
    for t in tokens:
        offsets.append(offsets[-1] + len(token_text(t)))
    for j, lab in enumerate(labels):
        k = max(0, _index_at(offsets, lab.char))
        top = tops[k] if k < len(tops) else None
        if not top:
            continue
        pr, pt = _label_mass(top, "result"), _label_mass(top, "think")
        if pr + pt > 0:
            probs[j] = pr / (pr + pt)
    return probs


def _index_at(offsets: list[int], char: int) -> int:
    """Index of the token whose span holds character ``char`` (offsets: token starts + end)."""
    lo, hi = 0, len(offsets) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= char:
            lo = mid
        else:
            hi = mid - 1
    return lo


def detect_model(
    thinking: Thinking,
    text: str,
    strength: str = "normal",
    tokens: Sequence[str] | None = None,
    tops: Sequence[dict[str, float] | None] | None = None,
) -> Detection:
    """Detection from the reflection model's output. Malformed output: no cut, typed status.

    ``text`` must be the concatenation of ``tokens`` when log-probs are given (see
    ``reflection_model.ModelOutput``): label offsets index the tokens.
    """
    n = len(thinking.chunks)
    labels = parse_labels(text, n)
    if labels is None:
        found = len(_LABEL.findall(text))
        return Detection(
            cut=None, status="malformed_output", detail=f"{found} labels for {n} chunks (need 1..{n})"
        )
    probs = result_probs(labels, tokens, tops)
    results = [i for i, p in enumerate(probs) if p >= 0.5]
    if strength == "weak":
        if len(results) < 2:
            return Detection(
                cut=None, status="no_detection", detail="fewer than two Result chunks", probs=probs
            )
        return _at_chunk(thinking, results[1], probs)
    if strength == "strong":
        likely = [i for i, p in enumerate(probs) if p >= 0.25]
        if likely:
            return _at_chunk(thinking, likely[0], probs)
    if results:
        return _at_chunk(thinking, results[0], probs)
    return Detection(cut=None, status="no_detection", detail="no chunk labelled Result", probs=probs)
