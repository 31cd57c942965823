"""The shipped checkpoint loads offline, round-trips markers and answers in every format."""

from __future__ import annotations

import json

import pytest
import torch

from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, FORCED_ENDING
from loom.runtime import configure_process
from zoo.tiny import CHECKPOINT_DIR, HELDOUT_SEED, load_model, load_tokenizer, tiny_problems
from zoo.tiny.evaluate import eval_plain, eval_spawn, eval_stream


@pytest.fixture(scope="module")
def tiny():
    configure_process()
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("TRANSFORMERS_OFFLINE", "1")
    try:
        yield load_model(), load_tokenizer()
    finally:
        mp.undo()


def test_checkpoint_is_small_and_has_a_card():
    size = sum(p.stat().st_size for p in CHECKPOINT_DIR.iterdir())
    assert size < 20 * 2**20
    card = json.loads((CHECKPOINT_DIR / "card.json").read_text())
    for fmt in ("plain", "reflect", "stream", "spawn"):
        assert 0.0 < card["heldout"][fmt]["accuracy"] < 1.0, fmt  # room for RL either way
    assert (CHECKPOINT_DIR / "MODEL_CARD.md").exists()


def test_markers_round_trip_as_single_tokens(tiny):
    _, tok = tiny
    for marker in [*DEFAULT_MARKERS.special_tokens(), *DEFAULT_SPAWN.tokens]:
        ids = tok(marker, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, marker
        assert tok.decode(ids) == marker
    text = " 47+85<EOT> Now reason step by step, then answer. 7+5=12<EOR> \\boxed{132}<EOA>"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.decode(tok(FORCED_ENDING)["input_ids"]) == FORCED_ENDING
    digits = tok.convert_ids_to_tokens(tok("12345")["input_ids"])
    assert digits == ["1", "2", "3", "4", "5"]
    assert tok.eos_token == "<|eos|>" and tok.pad_token_id != tok.eos_token_id
    assert tok("x")["input_ids"] == tok("x", add_special_tokens=False)["input_ids"]  # nothing added


def _heldout(kind, n):
    return tiny_problems(kind, n, seed=HELDOUT_SEED, split="test")  # the card's held-out set


@pytest.mark.parametrize("fmt", ["plain", "reflect"])
def test_generates_verified_answers_plain_and_reflect(tiny, fmt):
    model, tok = tiny
    problems = _heldout("arith", 8) + _heldout("countdown", 8)
    res = eval_plain(model, tok, problems, reflect=fmt == "reflect")
    assert res.parsed >= res.total // 2, res.sample
    assert res.correct >= 1, res.sample
    if fmt == "reflect":
        assert "</think>" in res.sample and "\\boxed{" in res.sample.split("</think>")[-1]


def test_generates_verified_answers_streaming(tiny):
    model, tok = tiny
    res = eval_stream(model, tok, _heldout("arith", 8) + _heldout("countdown", 8))
    assert res.parsed >= res.total // 2, res.sample
    assert res.correct >= 1, res.sample
    assert DEFAULT_MARKERS.thought_end in res.sample and DEFAULT_MARKERS.reasoning_end in res.sample


def test_generates_verified_answers_spawn(tiny):
    model, tok = tiny
    res = eval_spawn(model, tok, _heldout("countdown", 12))
    assert res.parsed >= res.total // 2, res.sample
    assert res.correct >= 1, res.sample
    assert DEFAULT_SPAWN.spawn_close in res.sample and DEFAULT_SPAWN.join_close in res.sample


def test_generation_is_greedy_deterministic(tiny):
    model, tok = tiny
    enc = tok("[plain] Compute 12+34.\n", return_tensors="pt")
    with torch.no_grad():
        a = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
        b = model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(a, b)
