"""Training is reproducible: the same seed gives the same tokenizer, data and losses."""

from __future__ import annotations

from loom.runtime import configure_process
from loom.tiny.train import TrainConfig, train


def test_short_training_is_reproducible_with_the_same_seed(tmp_path):
    configure_process()
    cfg = TrainConfig(seed=5, steps=4, batch_size=4, train_problems=60, eval_problems=2)
    first = train(cfg, tmp_path / "a", progress=False, evaluate_after=False)
    second = train(cfg, tmp_path / "b", progress=False, evaluate_after=False)
    assert len(first["losses"]) == 4
    assert first["losses"] == second["losses"]
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    other = train(
        TrainConfig(seed=6, steps=4, batch_size=4, train_problems=60),
        None,
        progress=False,
        evaluate_after=False,
    )
    assert other["losses"] != first["losses"]
