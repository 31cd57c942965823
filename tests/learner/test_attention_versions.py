"""Attention scores under exactly the rollout's policy version, whichever lineage the learner trained
last (docs/security.md "Runs' lineages"): a real Learner, real train steps, a real policy store."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.config import LearnerSettings
from learner.tasks import score_attention
from learner.train import AttentionVersionUnavailable, Learner, _load_causal_lm
from loom.contracts.wire import Lineage, LossSpec, TrainBatch
from loom.fci import fci_scores

IDS = list(range(1, 31))
STEPS = [(0, 5), (5, 10), (10, 15), (15, 20), (20, 25), (25, 30)]
LOSS = LossSpec(lr=0.05)  # steps that move the weights enough to tell two lineages apart


def test_scores_are_the_requested_lineages_whichever_trained_last(
    model_dir: Path, tmp_path: Path, batch_parts, monkeypatch
) -> None:
    from learner import tasks

    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store", resident_runs=1))
    monkeypatch.setattr(tasks, "_learner", learner)  # the worker's learner: this one
    for seed, ns in ((1, "run-a"), (2, "run-b")):  # B trains last; A leaves memory (resident_runs=1)
        groups, rewards = batch_parts(seed=seed)
        learner.train_step(
            TrainBatch(step=0, lineage=Lineage(namespace=ns), groups=groups, rewards=rewards, loss=LOSS)
        )
    scored = {}
    for ns in ("run-a", "run-b", None):
        path = model_dir if ns is None else tmp_path / "store" / "ns" / ns / "v1"
        direct = fci_scores(_load_causal_lm(path).eval(), IDS, STEPS, delta=2)
        out = score_attention(IDS, [list(s) for s in STEPS], 2, None, 0 if ns is None else 1, ns)
        assert out["scores"] == pytest.approx(direct, abs=1e-5), ns
        scored[ns] = out["scores"]
    assert scored["run-a"] != scored["run-b"]  # different weights: a wrong lineage would show
    for ns, version in (("run-a", 2), ("run-c", 1), ("../x", 1)):
        out = score_attention(IDS, [list(s) for s in STEPS], 2, None, version, ns)
        assert out["error"] == "attention_version_unavailable" and "scores" not in out
        with pytest.raises(AttentionVersionUnavailable):
            learner.scoring_model(ns, version)


def test_a_lora_version_scores_with_the_base_and_its_adapter(
    model_dir: Path, tmp_path: Path, batch_parts
) -> None:
    from peft import PeftModel

    cfg = LearnerSettings(model=model_dir, store=tmp_path / "store", resident_runs=1, lora_rank=4)
    learner = Learner(cfg)
    for seed, ns in ((1, "run-a"), (2, "run-b")):
        groups, rewards = batch_parts(seed=seed)
        batch = TrainBatch(step=0, lineage=Lineage(namespace=ns), groups=groups, rewards=rewards, loss=LOSS)
        learner.train_step(batch)
    adapter = tmp_path / "store" / "ns" / "run-a" / "v1"
    assert learner.home.namespace("run-a").get(1).kind == "lora"  # type: ignore[union-attr]
    assert "run-a" not in learner.resident  # read from the store
    merged = PeftModel.from_pretrained(_load_causal_lm(model_dir), str(adapter)).merge_and_unload()
    direct = fci_scores(merged.eval(), IDS, STEPS, delta=2)
    scores = fci_scores(learner.scoring_model("run-a", 1), IDS, STEPS, delta=2)
    assert scores == pytest.approx(direct, abs=1e-5)
    assert scores != pytest.approx(fci_scores(_load_causal_lm(model_dir).eval(), IDS, STEPS, delta=2))
