"""Training is reproducible (the same seed gives the same tokenizer, data and losses) and its card
records the held-out rows in card.json, MODEL_CARD.md and on screen."""

from __future__ import annotations

import json

from loom.runtime import configure_process
from zoo.recipe import TrainConfig, print_card, train
from zoo.recipes import RECIPES
from zoo.tiny.train import MIX


def test_short_training_is_reproducible_with_the_same_seed(tmp_path):
    configure_process()
    cfg = TrainConfig(seed=5, steps=4, batch_size=4, train_problems=60, eval_problems=2)
    first = train(RECIPES["tiny"], cfg, tmp_path / "a", progress=False, evaluate_after=False)
    second = train(RECIPES["tiny"], cfg, tmp_path / "b", progress=False, evaluate_after=False)
    assert len(first["losses"]) == 4
    assert first["losses"] == second["losses"]
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    other = train(
        RECIPES["tiny"],
        TrainConfig(seed=6, steps=4, batch_size=4, train_problems=60),
        None,
        progress=False,
        evaluate_after=False,
    )
    assert other["losses"] != first["losses"]


def test_the_card_records_the_heldout_rows_on_disk_and_on_screen(tmp_path, capsys):
    configure_process()
    cfg = TrainConfig(seed=5, steps=2, batch_size=4, train_problems=60, eval_problems=1)
    card = train(RECIPES["tiny"], cfg, tmp_path, progress=False, evaluate_after=True)
    saved = json.loads((tmp_path / "card.json").read_text())
    assert (
        "losses" not in saved
        and "samples" not in saved
        and saved["loss_every_50"] == [round(card["losses"][0], 4)]
    )
    assert saved["final_loss"] == round(sum(card["losses"]) / 2, 4)
    assert set(saved["heldout"]) == set(MIX)
    assert all(set(r) == {"accuracy", "parsed", "correct", "total"} for r in saved["heldout"].values())
    rows = (
        (tmp_path / "MODEL_CARD.md")
        .read_text()
        .split("| format | accuracy | parsed | total |\n|---|---|---|---|\n")[1]
    )
    assert [line.split(" | ")[0] for line in rows.splitlines()] == [f"| {fmt}" for fmt in MIX]
    print_card(card)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"params {card['params']:,}  train ")
    assert [line.split()[1] for line in printed[1:]] == list(MIX)
