"""Chunking of the thinking part: token-exact offsets, blank-line split, >= min tokens ending a
sentence, capped at max tokens (tiny model tokenizer, a real byte-level BPE)."""

from __future__ import annotations

import itertools
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reflect_helpers import decoder, trace_group  # noqa: E402

from reflect_svc.chunking import chunk_thinking, ends_sentence, token_starts  # noqa: E402


def check_exact(th, ids, dec):
    """Chunks tile the thinking part and each chunk's text is the decode of its own tokens."""
    assert th.chunks[0].start == th.start and th.chunks[-1].end == th.end
    for a, b in zip(th.chunks, th.chunks[1:], strict=False):
        assert a.end == b.start
    for c in th.chunks:
        assert c.text == dec(list(ids[c.start : c.end]))


def test_offsets_are_token_exact_and_exclude_the_think_tags(tok):
    dec = decoder(tok)
    for kind in ("arith", "countdown"):
        g = trace_group(tok, kind, n=3, seed=11)
        for t in g.trajectories:
            ids = t.completion_ids
            th = chunk_thinking(ids, dec)
            assert th.closed
            assert dec(ids[: th.start]) == "<think>"
            assert dec(ids[th.end :]).startswith("</think>")
            check_exact(th, ids, dec)
            assert "".join(c.text for c in th.chunks) == dec(ids[th.start : th.end])


def test_blank_lines_split_and_the_separator_opens_the_next_chunk(tok):
    dec = decoder(tok)
    para = "I add the units digits and carry one to the tens column as usual."  # > 8 tokens, a sentence
    text = "<think> " + "\n\n".join([para, para, para]) + "\n</think> done"
    ids = tok.encode(text, add_special_tokens=False)
    th = chunk_thinking(ids, dec, min_tokens=8, max_tokens=128)
    assert len(th.chunks) == 3
    assert th.chunks[0].text.endswith("as usual.")
    assert th.chunks[1].text.startswith("\n\n") and th.chunks[2].text.startswith("\n\n")
    check_exact(th, ids, dec)


def test_short_pieces_merge_until_min_tokens_and_a_sentence_end(tok):
    dec = decoder(tok)
    text = "<think> 1+2=3\n\n3+4=7\n\nSo it is 7.\n\nWait, check 7 again. Yes it is seven.\n</think>"
    ids = tok.encode(text, add_special_tokens=False)
    th = chunk_thinking(ids, dec, min_tokens=12, max_tokens=128)
    first = th.chunks[0]
    # "1+2=3" and "3+4=7" do not end a sentence: merged into the chunk that does
    assert "1+2=3" in first.text and "So it is 7." in first.text and first.n_tokens >= 12
    assert ends_sentence(first.text)
    for c in th.chunks[:-1]:
        assert c.n_tokens >= 12 and ends_sentence(c.text)
    check_exact(th, ids, dec)


def test_no_chunk_exceeds_the_cap_even_without_blank_lines(tok):
    dec = decoder(tok)
    lines = "\n".join(f"{i}+{i}={2 * i} r{2 * i}" for i in range(60))  # one long piece, no sentence end
    ids = tok.encode(f"<think> {lines}\n</think>", add_special_tokens=False)
    th = chunk_thinking(ids, dec, min_tokens=32, max_tokens=40)
    assert len(th.chunks) > 5
    assert all(c.n_tokens <= 40 for c in th.chunks)
    check_exact(th, ids, dec)


def test_unclosed_thinking_runs_to_the_end_and_multibyte_text_stays_exact(tok):
    dec = decoder(tok)
    text = "<think> Das Ergebnis ist 42 — sicher? Ja 😀 héhé.\n\nÜberprüfe: 6·7=42. Stimmt."
    ids = tok.encode(text, add_special_tokens=False)
    joined = "".join(dec([t]) for t in ids)
    assert joined != dec(ids)  # byte-level pieces of multi-byte characters: the exact fallback runs
    full, starts = token_starts(ids, dec)
    assert full == dec(ids) and starts[-1] == len(full)
    th = chunk_thinking(ids, dec, min_tokens=4)
    assert not th.closed and th.end == len(ids)
    check_exact(th, ids, dec)
    assert "".join(c.text for c in th.chunks) == full[len("<think>") :]


def test_no_think_tag_means_the_whole_completion_is_thinking(tok):
    dec = decoder(tok)
    ids = tok.encode("Just an answer without tags. It is 5.", add_special_tokens=False)
    th = chunk_thinking(ids, dec, min_tokens=2)
    assert th.start == 0 and th.end == len(ids)
    check_exact(th, ids, dec)


def prefix_starts(ids, dec):
    """The reference: every token's offset from decoding every prefix (the old quadratic path)."""
    text = dec(list(ids))
    pieces = [dec([t]) for t in ids]
    if "".join(pieces) == text:
        return text, [0, *itertools.accumulate(len(p) for p in pieces)]
    return text, [0] + [len(dec(list(ids[:k]))) for k in range(1, len(ids) + 1)]


def test_offsets_equal_prefix_decoding_on_multibyte_and_broken_utf8(tok):
    dec = decoder(tok)

    def strip_first_space(ids):  # a decoder that treats the first token apart (SentencePiece-like)
        s = dec(ids)
        return s[1:] if s.startswith(" ") else s

    rng = random.Random(0)
    alphabet = [*"ab .\n7", "π", "😀", "中文", "\ufffd", "é", "🇫🇷", "👨‍👩‍👧", "<think>", "</think>"]
    cases = []
    for _ in range(400):
        ids = tok.encode("".join(rng.choices(alphabet, k=rng.randrange(1, 25))), add_special_tokens=False)
        cases.append(ids)
        a = rng.randrange(len(ids))
        cases.append(ids[a : a + rng.randrange(1, len(ids) + 1)])  # cut inside characters
        cases.append([rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))])  # raw bytes: invalid
    for ids in cases:
        for d in (dec, strip_first_space):
            assert token_starts(ids, d) == prefix_starts(ids, d), ids


def test_a_split_multibyte_character_keeps_offsets_linear(tok):
    """One "π" in an 8.7k-token thinking part decoded every prefix (12 s): now short windows only."""
    dec = decoder(tok)
    ids = tok.encode(
        "<think>π" + "Let x be 2. So x+1 is 3. Then the result is 7.\n\n" * 300, add_special_tokens=False
    )
    decoded = 0

    def counting(part):
        nonlocal decoded
        decoded += len(part)
        return dec(part)

    t0 = time.perf_counter()
    th = chunk_thinking(ids, counting)
    elapsed = time.perf_counter() - t0
    assert len(ids) > 8000 and th.chunks
    assert decoded <= 6 * len(ids)  # the prefixes were ~n²/2 = 38M tokens
    assert elapsed < 3.0
    assert token_starts(ids[:600], dec) == prefix_starts(ids[:600], dec)


def test_crossed_chunk_bounds_are_refused(tok):
    ids = tok.encode("<think> a. b. c.\n</think>", add_special_tokens=False)
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        chunk_thinking(ids, decoder(tok), min_tokens=500, max_tokens=1)
