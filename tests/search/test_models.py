"""Built-in model names (zoo/registry.py) resolve the same way for every service."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.train import resolve_model_path as learner_path
from loom.contracts.settings import Settings
from rollout_svc.rollout import base_policy
from zoo.registry import BUILTIN, resolve_model_path
from zoo.search import (
    DEEP_CHECKPOINT_DIR,
    REFLECT_CHECKPOINT_DIR,
    SEARCH_CHECKPOINT_DIR,
    STREAM_CHECKPOINT_DIR,
)
from zoo.tiny import CHECKPOINT_DIR, load_model, load_tokenizer, plain_prompt, tiny_problems

ZOO = Path(__file__).resolve().parents[2] / "zoo"


def test_names_resolve_to_the_shipped_checkpoints_and_anything_else_is_a_path(tmp_path: Path):
    assert resolve_model_path("tiny") == CHECKPOINT_DIR
    assert resolve_model_path("search") == SEARCH_CHECKPOINT_DIR
    assert resolve_model_path("stream") == STREAM_CHECKPOINT_DIR
    assert resolve_model_path("reflect") == REFLECT_CHECKPOINT_DIR
    assert resolve_model_path("deep") == DEEP_CHECKPOINT_DIR
    assert resolve_model_path(str(tmp_path)) == tmp_path
    dirs = {CHECKPOINT_DIR, SEARCH_CHECKPOINT_DIR, STREAM_CHECKPOINT_DIR, REFLECT_CHECKPOINT_DIR}
    dirs.add(DEEP_CHECKPOINT_DIR)
    assert len(dirs) == 5 and all((d / "model.safetensors").is_file() for d in dirs)


def test_the_rollout_services_base_policy_follows_loom_model(monkeypatch):
    monkeypatch.setenv("LOOM_MODEL", "search")
    assert base_policy(Settings()).path == str(SEARCH_CHECKPOINT_DIR)
    monkeypatch.setenv("LOOM_MODEL", "tiny")
    assert base_policy(Settings()).path == str(CHECKPOINT_DIR)


@pytest.mark.parametrize("name", BUILTIN)
def test_every_built_in_model_loads_by_name_from_the_zoo(monkeypatch: pytest.MonkeyPatch, name: str):
    monkeypatch.setenv("LOOM_MODEL", name)
    path = Path(base_policy(Settings()).path)
    assert path.is_relative_to(ZOO) and path == learner_path(name)  # the learner resolves it the same
    tok, model = load_tokenizer(path), load_model(path)
    ids = tok(plain_prompt(tiny_problems("arith", 1, seed=0)[0]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size) and torch.isfinite(logits).all()
