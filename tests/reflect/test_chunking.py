"""Chunking of the thinking part: token-exact offsets, blank-line split, >= min tokens ending a
sentence, capped at max tokens (tiny model tokenizer, a real byte-level BPE)."""

from __future__ import annotations

import sys
from pathlib import Path

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
