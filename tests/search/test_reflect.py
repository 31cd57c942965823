"""The reflect model's traces (zoo/search/reflect.py, issue 38): the search model's search with
backtracking words (and, with ``mistake``, a wrong finish caught by a check), then the right answer and
redundant re-checks; reflect_svc's chunks and gold detector cut after the right answer, keeping the
search's reflections and removing the re-checks; the checkpoint ships and loads."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from loom.formats import REFLECTION_KEYWORDS
from reflect_svc.chunking import chunk_thinking
from reflect_svc.detectors import detect_gold
from reward_svc.match import MatchRequest, finish_matches, plan_matches
from reward_svc.reflection import count_reflections
from zoo.recipes import model_card
from zoo.registry import resolve_model_path
from zoo.search import REFLECT_CHECKPOINT_DIR, load_tokenizer, search_problems
from zoo.search.reflect import reflect_think, reflect_trace
from zoo.search.traces import reflect_trace as search_reflect_trace
from zoo.tiny.evaluate import last_boxed
from zoo.tiny.traces import trace_text


def _problems(n: int = 200):
    return search_problems("countdown", n, 0, "train")


def _thinking(text: str) -> str:
    return text.split("<think>", 1)[1].split("</think>", 1)[0]


@pytest.mark.parametrize("mistake", [0.0, 0.3])
def test_the_answer_is_right_and_the_mistakes_are_caught_before_it(mistake: float):
    mistakes = 0
    for p in _problems():
        for v in range(2):
            text = trace_text(reflect_trace(p, v, mistake=mistake))
            assert p.verify(last_boxed(text)), text
            think = _thinking(text)
            stated = [line for line in think.split("\n") if line.startswith("So the answer is ")]
            # every stated answer but the last is a mistake, and a check saying "No." follows it
            assert p.verify(stated[-1].removeprefix("So the answer is ").rstrip("."))
            for wrong in stated[:-1]:
                assert not p.verify(wrong.removeprefix("So the answer is ").rstrip("."))
                after = think.split(wrong, 1)[1]
                assert after.startswith("\n\nWait, let me check: ") and after.split("\n")[2].endswith(". No.")
            mistakes += len(stated) - 1
    share = mistakes / (2 * len(_problems()))
    # only traces with a failed move before the finish can hold one; none by default
    assert 0.5 * mistake < share < mistake if mistake else share == 0


def test_reflections_come_before_the_answer_unlike_the_search_models_traces():
    def before_answer(text: str) -> int:
        think = _thinking(text)
        cut = think.rfind("So the answer is ")
        return count_reflections(think[:cut], list(REFLECTION_KEYWORDS))

    ours = [before_answer(trace_text(reflect_trace(p, 0))) for p in _problems()]
    theirs = [before_answer(trace_text(search_reflect_trace(p, 0))) for p in _problems()]
    assert max(theirs) == 0  # the search model's reflections all follow the answer
    assert statistics.mean(ours) > 0.7 and max(ours) >= 2


def test_the_gold_detector_cuts_after_the_right_answer_keeping_the_searchs_reflections():
    tok = load_tokenizer()

    def decode(ids: list[int]) -> str:
        return str(tok.decode(ids))

    cut_some, kept_reflective = 0, 0
    for p in _problems(60):
        text = trace_text(reflect_trace(p, 0, checks=(2, 2)))
        completion = text.split("\n", 1)[1]  # the prompt line is not the policy's
        ids = tok(completion, add_special_tokens=False)["input_ids"]
        thinking = chunk_thinking(ids, decode, min_tokens=8, max_tokens=128)
        label = json.dumps({"numbers": list(p.numbers), "target": p.target})
        req = MatchRequest(label=label, task="countdown", texts=[c.text for c in thinking.chunks])
        decided, pending = plan_matches(req)
        assert not pending  # Countdown is verified in process, no math-verify item
        verdicts = [v.correct for v in finish_matches(decided, [], []).verdicts]
        found = detect_gold(thinking, verdicts)
        assert found.cut is not None and found.chunk is not None
        kept = decode(ids[: found.cut])
        assert kept.rstrip().endswith(f"So the answer is {last_boxed(text)}.")  # the right answer
        removed = decode(ids[found.cut : thinking.end])
        cut_some += removed.count(". Yes.") == 2  # both re-checks removed
        kept_reflective += count_reflections(_thinking(kept + "</think>"), list(REFLECTION_KEYWORDS)) > 0
    assert cut_some == 60
    assert kept_reflective > 0.6 * 60


def test_one_problems_traces_vary_and_a_think_is_deterministic_per_seed():
    p = _problems(1)[0]
    a = reflect_think(p, random.Random(5), (1, 3))
    assert a == reflect_think(p, random.Random(5), (1, 3))
    assert len({trace_text(reflect_trace(p, v)) for v in range(6)}) > 1


def test_the_shipped_checkpoint_resolves_loads_and_its_card_is_written_from_card_json():
    assert resolve_model_path("reflect") == REFLECT_CHECKPOINT_DIR
    if not (REFLECT_CHECKPOINT_DIR / "config.json").exists():
        pytest.fail(f"no reflect checkpoint at {REFLECT_CHECKPOINT_DIR}: run `loom train-reflect`")
    size = sum(f.stat().st_size for f in Path(REFLECT_CHECKPOINT_DIR).iterdir())
    assert size < 20 * 2**20
    card = json.loads((REFLECT_CHECKPOINT_DIR / "card.json").read_text())
    assert card["heldout"]["reflect"]["total"] >= 40 and card["heldout"]["reflect"]["accuracy"] > 0.0
    assert model_card("reflect", card) == (REFLECT_CHECKPOINT_DIR / "MODEL_CARD.md").read_text()
    assert load_tokenizer(REFLECT_CHECKPOINT_DIR).get_vocab() == load_tokenizer().get_vocab()


@pytest.mark.slow
def test_train_reflect_starts_from_the_search_model_and_writes_a_checkpoint(tmp_path: Path):
    from loom.runtime import configure_process
    from zoo.recipe import train
    from zoo.recipes import RECIPES, main
    from zoo.search.reflect import ReflectTrainConfig

    configure_process()
    cfg = ReflectTrainConfig(steps=2, warmup=1, train_problems=12, batch_size=4, max_len=256, eval_problems=2)
    card = train(RECIPES["reflect"], cfg, tmp_path / "a")
    assert card["init"] == "search" and card["final_loss"] > 0 and card["sequences"] == 12 * 3 + 12 * 2
    assert set(card["heldout"]) == {"plain", "reflect"} and card["heldout"]["reflect"]["total"] == 2
    saved = json.loads((tmp_path / "a" / "card.json").read_text())
    assert model_card("reflect", saved) == (tmp_path / "a" / "MODEL_CARD.md").read_text()
    argv = ["--init", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--steps", "1", "--batch-size", "2"]
    assert main("reflect", [*argv, "--train-problems", "6", "--no-eval"]) == 0
    assert json.loads((tmp_path / "b" / "card.json").read_text())["init"] == str(tmp_path / "a")
