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
    """The reference, from decoding every prefix: each token's offset where the tokens decode one by
    one into the text; otherwise how much of the text each prefix has fixed (the longest prefix of
    the text that it agrees with, trailing U+FFFD not counted: they may be pending bytes), never
    decreasing, and the text's length after the last token."""
    text = dec(list(ids))
    pieces = [dec([t]) for t in ids]
    if "".join(pieces) == text:
        return text, [0, *itertools.accumulate(len(p) for p in pieces)]
    starts = [0]
    for k in range(1, len(ids)):
        head = dec(list(ids[:k])).rstrip("\ufffd")
        agree = next((i for i, (a, b) in enumerate(zip(head, text, strict=False)) if a != b), None)
        starts.append(max(starts[-1], min(len(head), len(text)) if agree is None else agree))
    return text, [*starts, len(text)]


def test_offsets_equal_the_prefix_reference_on_multibyte_and_broken_utf8(tok):
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


def byte_fallback_tokenizer():  # type: ignore[no-untyped-def]
    """A real SentencePiece-style fast tokenizer: letters and digits as pieces, every other character
    as its UTF-8 bytes (<0xNN>), decoded with ByteFallback: one U+FFFD per pending byte (Llama 2,
    Mistral). A 4-byte character is 4 tokens whose prefixes decode as 1, 2, 3 U+FFFD, then 1 char."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in ["▁", *string.ascii_letters, *string.digits, *".,?!=+-<>/"]:
        vocab.setdefault(ch, len(vocab))
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    return fast, lambda ids: fast.decode(ids)


def test_byte_fallback_tokenizers_keep_offsets_exact_and_linear():
    """Each pending byte of a byte-fallback decoder is its own U+FFFD, and a byte run decodes as a
    whole, so the windows took the second byte of a 3- or 4-byte character for a final boundary:
    every prefix was decoded instead (1171 tokens: 0.18 s, quadratic), and the offsets of the
    bytes inside a character went up and down (a cut found from them could split the character)."""
    fast, dec = byte_fallback_tokenizer()
    rng = random.Random(1)
    alphabet = [*"ab .\n7", "π", "😀", "中文", "\ufffd", "é", "🇫🇷", " word", "  "]
    for _ in range(600):
        ids = fast.encode("".join(rng.choices(alphabet, k=rng.randrange(1, 25))), add_special_tokens=False)
        for case in (ids, ids[rng.randrange(len(ids)) :], [rng.randrange(3, len(fast)) for _ in range(40)]):
            assert token_starts(case, dec) == prefix_starts(case, dec), case
    ids = fast.encode("<think> So the answer is 12. 😀 Wait, check. " * 300, add_special_tokens=False)
    decoded = 0

    def counting(part):  # type: ignore[no-untyped-def]
        nonlocal decoded
        decoded += len(part)
        return dec(part)

    text, starts = token_starts(ids, counting)
    assert len(ids) > 10_000 and text == dec(ids) and starts[-1] == len(text)
    assert decoded <= 12 * len(ids)  # every prefix: ~n^2/2 = 60M tokens
    assert token_starts(ids[:700], dec) == prefix_starts(ids[:700], dec)
    # a byte run that never settles (U+FFFD after U+FFFD): windows are bounded, offsets stay ordered
    ids = fast.encode("\ufffd" * 3000 + " a", add_special_tokens=False)
    decoded = 0
    text, starts = token_starts(ids, counting)
    assert text == dec(ids) and starts[-1] == len(text) and starts == sorted(starts)
    assert decoded <= 40 * len(ids)


def test_crossed_chunk_bounds_are_refused(tok):
    ids = tok.encode("<think> a. b. c.\n</think>", add_special_tokens=False)
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        chunk_thinking(ids, decoder(tok), min_tokens=500, max_tokens=1)
