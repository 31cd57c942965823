"""LoRA through peft: the learner trains a rank-8 adapter on the tiny checkpoint, publishes it as
``kind=lora``, and the torch engine serving that version samples with the log-probs of the learner's
merged model (docs/algorithms.md §5.2)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from learner import logprobs as lp
from learner.config import LearnerSettings
from learner.train import ADAPTER_DIR, Learner
from loom.contracts.wire import LossSpec, SamplingParams, TrainBatch, Trajectory
from loom.store import PolicyStore
from rollout_svc.engines.torch.engine import TorchEngine
from rollout_svc.engines.torch.model import resolve_model_path

pytest.importorskip("peft")

ATOL = 2e-5  # float32, merged weights W + s B A against the unmerged adapter forward on CPU


def _train(tmp_path: Path, batch_parts, merge: bool = False) -> Learner:
    cfg = LearnerSettings(
        model="tiny", store=tmp_path / "store", lora_rank=8, lora_alpha=16, lora_merge=merge
    )
    learner = Learner(cfg)
    groups, rewards = batch_parts(streaming=False, behaviour=None)
    for step in range(3):
        learner.train_step(TrainBatch(step=step, groups=groups, rewards=rewards, loss=LossSpec(lr=5e-3)))
    return learner


def _learner_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    t = Trajectory(
        id="t", group_id="g", prompt_ids=prompt, completion_ids=tokens, loss_mask=[1] * len(tokens)
    )
    with torch.no_grad():
        out, _, _ = lp.completion_logprobs(model, [lp.layout_of(t)])
    return out[0, : len(tokens)].tolist()


def test_a_published_adapter_is_served_by_the_torch_engine_with_the_learners_logprobs(tmp_path, batch_parts):
    learner = _train(tmp_path, batch_parts)
    record = PolicyStore(tmp_path / "store").latest()
    assert record is not None and record.kind == "lora" and record.version == 3
    config = json.loads((Path(record.path) / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not (Path(record.path) / "model.safetensors").exists()  # an adapter, not the whole model
    merged = copy.deepcopy(learner.model).merge_and_unload().eval()

    engine = TorchEngine(resolve_model_path("tiny"), batching=False)
    prompt = [5, 6, 7, 8]
    params = SamplingParams(n=2, max_tokens=10, temperature=1.0, seed=3)
    base = engine.generate_sync(prompt, params)
    engine.load_policy_sync(record)
    assert engine.policy_version == 3
    served = engine.generate_sync(prompt, params)
    for c in served:
        assert c.logprobs == pytest.approx(_learner_logprobs(merged, prompt, c.token_ids), abs=ATOL)
    # the adapter moved the policy: the base model gives the same tokens other log-probs
    moved = _learner_logprobs(engine_base_model(), prompt, served[0].token_ids)
    assert max(abs(a - b) for a, b in zip(moved, served[0].logprobs, strict=True)) > 100 * ATOL
    assert [c.logprobs for c in base] != [c.logprobs for c in served]


def engine_base_model():
    from rollout_svc.engines.torch.model import load_model

    return load_model(resolve_model_path("tiny"))


def test_merge_and_publish_writes_a_full_checkpoint_and_resumes_from_its_adapter(tmp_path, batch_parts):
    learner = _train(tmp_path, batch_parts, merge=True)
    record = PolicyStore(tmp_path / "store").latest()
    assert record is not None and record.kind == "full"
    assert (Path(record.path) / "model.safetensors").exists()
    assert (Path(record.path) / ADAPTER_DIR / "adapter_config.json").exists()
    engine = TorchEngine(resolve_model_path("tiny"), batching=False)
    engine.load_policy_sync(record)  # a plain HF checkpoint
    merged = copy.deepcopy(learner.model).merge_and_unload().eval()
    c = engine.generate_sync([5, 6, 7], SamplingParams(max_tokens=8, temperature=1.0, seed=1))[0]
    assert c.logprobs == pytest.approx(_learner_logprobs(merged, [5, 6, 7], c.token_ids), abs=ATOL)
    resumed = Learner(learner.cfg)  # the trained adapter comes back, not a fresh one
    assert resumed.version == 3
    for (n, a), b in zip(learner.model.named_parameters(), resumed.model.parameters(), strict=True):
        if "lora_" in n:
            assert torch.equal(a.detach(), b.detach()), n


def test_the_learner_service_takes_lora_from_its_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """LOOM_LEARNER_LORA_* reach the learner's one configuration (learner.config.LearnerSettings, the
    class the worker builds its Learner from); the shared LOOM_MODEL and LOOM_DEVICE are read as every
    service reads them."""
    monkeypatch.setenv("LOOM_LEARNER_LORA_RANK", "8")
    monkeypatch.setenv("LOOM_LEARNER_LORA_TARGETS", "q_proj, v_proj")
    monkeypatch.setenv("LOOM_LEARNER_LORA_MERGE", "true")
    monkeypatch.setenv("LOOM_MODEL", "some/model")
    monkeypatch.setenv("LOOM_POLICY_STORE", "/tmp/the-store")
    monkeypatch.delenv("LOOM_DEVICE", raising=False)
    cfg = LearnerSettings()
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lora_merge) == (
        8,
        16,
        ("q_proj", "v_proj"),
        True,
    )
    assert (cfg.model, cfg.store, cfg.device) == ("some/model", Path("/tmp/the-store"), "cpu")
    assert LearnerSettings(lora_rank=0).lora_rank == 0
    # the helper ranks get rank 0's settings as JSON: the same settings come back
    assert LearnerSettings.model_validate_json(cfg.model_dump_json()) == cfg
