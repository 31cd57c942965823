"""Markers with any tokenizer (loom/formats.py, docs/models.md): canonical ids, the split encoding."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from qwen3_style import encode, qwen3_style_tokenizer  # noqa: E402

from loom.formats import DEFAULT_MARKERS, MarkerError, encode_with_markers, ends_with, marker_ids  # noqa: E402


def test_a_marker_is_one_id_where_it_is_a_token_and_its_text_encoded_alone_elsewhere() -> None:
    from zoo.tiny import load_tokenizer

    tiny, qwen = load_tokenizer(), qwen3_style_tokenizer()
    assert marker_ids(tiny, "<EOT>") == [tiny.convert_tokens_to_ids("<EOT>")]
    assert marker_ids(qwen, "</think>") == [qwen.convert_tokens_to_ids("</think>")]
    eot = marker_ids(qwen, "<EOT>")
    assert len(eot) > 1 and eot == encode(qwen, "<EOT>") and qwen.decode(eot) == "<EOT>"


def test_a_tokenizer_that_cannot_write_a_marker_is_refused_naming_it() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "we": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    with pytest.raises(MarkerError, match="'<EOT>'"):
        marker_ids(tok, "<EOT>")


def test_multi_token_markers_are_written_as_their_canonical_ids_and_the_rest_alone() -> None:
    """``"x.<EOS>"`` encoded whole may merge across the marker's edge; split, the marker is exactly
    its canonical ids, and one-token markers leave the encoding whole."""
    from zoo.tiny import load_tokenizer

    qwen, tiny = qwen3_style_tokenizer(), load_tokenizer()
    text = " add them.<EOS> then<EOT>\n"
    ids = encode_with_markers(qwen, text, DEFAULT_MARKERS.special_tokens())
    eos, eot = marker_ids(qwen, "<EOS>"), marker_ids(qwen, "<EOT>")
    assert ids == encode(qwen, " add them.") + eos + encode(qwen, " then") + eot + encode(qwen, "\n")
    assert qwen.decode(ids) == text
    assert encode_with_markers(tiny, text, DEFAULT_MARKERS.special_tokens()) == encode(tiny, text)
    assert ends_with(ids[:-1], eot) and not ends_with(ids, eot) and not ends_with(eot[1:], eot)
