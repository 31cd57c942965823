"""The stream model's traces (zoo/search/stream.py, issue 38): a reading phase whose length varies
across traces of one problem, every thought under the streaming segment cap, the search model's deep
phase; the traces pass Loom's own stream parser and format checks; the checkpoint ships and loads."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from loom.formats import DEFAULT_MARKERS
from zoo.recipes import model_card
from zoo.registry import resolve_model_path
from zoo.search import STREAM_CHECKPOINT_DIR, load_tokenizer, search_problems
from zoo.search.stream import VERBOSITY, _guess, stream_trace, wasteful_units
from zoo.search.traces import stream_trace as search_stream_trace
from zoo.tiny.traces import parse_stream, split_stream_text, stream_sentences, trace_text

M = DEFAULT_MARKERS


def _problems(n: int = 200):
    return search_problems("countdown", n, 0, "train")


def _thoughts(pieces) -> list[str]:
    return [p.text for p in pieces if p.train and M.reasoning_end not in p.text]


def test_every_thought_fits_the_segment_cap_and_the_phase_length_varies_per_trace():
    tok = load_tokenizer()
    lengths, most, varied = [], 0, 0
    for p in _problems():
        per_problem = set()
        for v in range(4):
            n = 0
            for t in _thoughts(stream_trace(p, v)):
                k = len(tok(t, add_special_tokens=False)["input_ids"])
                most, n = max(most, k), n + k
            lengths.append(n)
            per_problem.add(n)
        varied += len(per_problem) > 1
    assert varied > 0.9 * len(_problems())  # the verbosity is drawn per trace, not per problem
    assert most <= 32  # bench/adasr.py's --segment-cap: no wasteful thought is cut
    concise = [sum(len(tok(t)["input_ids"]) for t in _thoughts(search_stream_trace(p))) for p in _problems()]
    assert statistics.mean(lengths) > 2 * statistics.mean(concise)  # room for HRPO to shorten
    assert min(lengths) <= max(concise)  # and the shortest form is among the traces


def test_the_revealed_sentences_and_the_deep_phase_are_the_search_models():
    for p in _problems(50):
        ours, theirs = stream_trace(p, 1), search_stream_trace(p)
        assert [x.text for x in ours if not x.train] == [x.text for x in theirs if not x.train]
        assert ours[-1] == theirs[-1]  # the deep phase and the answer
        sentences = [s for s, _ in wasteful_units(p, random.Random(0))]
        assert sentences == stream_sentences(p)


def test_the_concise_form_is_the_minority():
    concise = []
    for p in _problems(300):
        short = _thoughts(search_stream_trace(p))
        for v in range(2):
            ours = _thoughts(stream_trace(p, v))
            concise.extend(a == b for a, b in zip(ours, short, strict=True))
    share = sum(concise) / len(concise)
    # a thought is concise when its trace drew verbosity 0 (VERBOSITY[0]) or none of its extras
    assert VERBOSITY[0] < share < 0.4


def test_a_trace_parses_and_its_answer_and_guesses_are_right():
    for p in _problems(60):
        text = trace_text(stream_trace(p, 0))
        segments, final = split_stream_text(text[len("[stream]") :])
        parsed = parse_stream(segments, final)
        assert parsed.well_formed and p.verify(parsed.answer), text
        for t in parsed.thoughts:
            assert t == M.skip or (t.strip() and M.skip not in t)  # reward_svc.format.stream_ok
    assert _guess([2, 4, 8], 64, random.Random(3)).endswith(("yes", "no"))
    assert _guess([2, 3], 5, _FixedOps("+")) == "guess 2+3=5 yes"
    assert _guess([2, 3], 7, _FixedOps("*")) == "guess 2*3=6 no"


class _FixedOps:
    def __init__(self, op: str) -> None:
        self.op = op

    def choice(self, _: str) -> str:
        return self.op


def test_the_shipped_checkpoint_resolves_loads_and_its_card_is_written_from_card_json():
    assert resolve_model_path("stream") == STREAM_CHECKPOINT_DIR
    if not (STREAM_CHECKPOINT_DIR / "config.json").exists():
        pytest.fail(f"no stream checkpoint at {STREAM_CHECKPOINT_DIR}: run `loom train-stream`")
    size = sum(f.stat().st_size for f in Path(STREAM_CHECKPOINT_DIR).iterdir())
    assert size < 20 * 2**20
    card = json.loads((STREAM_CHECKPOINT_DIR / "card.json").read_text())
    assert card["heldout"]["stream"]["total"] >= 40 and card["heldout"]["stream"]["accuracy"] > 0.0
    assert model_card("stream", card) == (STREAM_CHECKPOINT_DIR / "MODEL_CARD.md").read_text()
    tok = load_tokenizer(STREAM_CHECKPOINT_DIR)
    assert tok.get_vocab() == load_tokenizer().get_vocab()  # the search model's tokenizer


@pytest.mark.slow
def test_train_stream_starts_from_the_search_model_and_writes_a_checkpoint(tmp_path: Path):
    from loom.runtime import configure_process
    from zoo.recipe import train
    from zoo.recipes import RECIPES, main
    from zoo.search.stream import StreamTrainConfig

    configure_process()
    cfg = StreamTrainConfig(steps=2, warmup=1, train_problems=12, batch_size=4, max_len=256, eval_problems=2)
    card = train(RECIPES["stream"], cfg, tmp_path / "a")
    assert card["init"] == "search" and card["final_loss"] > 0 and card["sequences"] == 12 * 3 + 12 * 2
    assert set(card["heldout"]) == {"plain", "stream"} and card["heldout"]["stream"]["total"] == 2
    saved = json.loads((tmp_path / "a" / "card.json").read_text())
    assert model_card("stream", saved) == (tmp_path / "a" / "MODEL_CARD.md").read_text()
    assert load_tokenizer(tmp_path / "a").get_vocab() == load_tokenizer().get_vocab()
    # --init continues from any checkpoint (here the one just written), recorded by its path
    argv = ["--init", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--steps", "1", "--batch-size", "2"]
    argv += ["--train-problems", "6"]
    assert main("stream", [*argv, "--no-eval"]) == 0
    assert json.loads((tmp_path / "b" / "card.json").read_text())["init"] == str(tmp_path / "a")
