"""``loom train-search`` end to end at a few steps (issue 29): phase 1, then rounds of phase 2, each
round recorded on the card; ``--init`` continues from a checkpoint's card and numbers its rounds on."""

from __future__ import annotations

import json

import pytest

from loom.runtime import configure_process
from zoo.recipes import main
from zoo.search.train import SearchTrainConfig, train

pytestmark = pytest.mark.slow


def test_two_fixed_rounds_then_one_more_from_the_checkpoint(tmp_path):
    configure_process()
    cfg = SearchTrainConfig(
        steps=2, warmup=1, fixed_steps=2, fixed_rounds=2, train_problems=12, batch_size=4, max_len=128
    )
    card = train(cfg, tmp_path / "a", progress=False, evaluate_after=False)
    assert list(card["phases"]) == ["drawn", "fixed", "fixed_2"]
    assert all(ph["steps"] == 2 and ph["final_loss"] > 0 for ph in card["phases"].values())
    saved = json.loads((tmp_path / "a" / "card.json").read_text())
    assert saved["config"]["fixed_rounds"] == 2 and list(saved["phases"]) == ["drawn", "fixed", "fixed_2"]
    assert "--fixed-rounds 2" in (tmp_path / "a" / "MODEL_CARD.md").read_text()

    argv = ["--init", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--fixed-steps", "2"]
    argv += ["--fixed-rounds", "1", "--train-problems", "12", "--batch-size", "4", "--no-eval"]
    assert main("search", argv) == 0
    resumed = json.loads((tmp_path / "b" / "card.json").read_text())
    assert list(resumed["phases"]) == ["drawn", "fixed", "fixed_2", "fixed_3"]
    assert resumed["phases"]["drawn"] == saved["phases"]["drawn"]  # carried from the first card
