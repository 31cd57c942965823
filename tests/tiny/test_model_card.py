"""The checked-in MODEL_CARD.md of each built-in checkpoint is what ``model_card`` writes from its
card.json (zoo/tiny/train.py card_markdown serves both)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from zoo.search.train import model_card as search_card
from zoo.tiny.train import model_card as tiny_card

ROOT = Path(__file__).resolve().parents[2] / "zoo"


@pytest.mark.parametrize(("name", "model_card"), [("tiny", tiny_card), ("search", search_card)])
def test_the_checked_in_card_is_written_from_card_json(name: str, model_card: Callable[[dict], str]) -> None:
    checkpoint = ROOT / name / "checkpoint"
    card = json.loads((checkpoint / "card.json").read_text())
    assert model_card(card) == (checkpoint / "MODEL_CARD.md").read_text()
