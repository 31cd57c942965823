"""Built-in model names (zoo/registry.py) resolve the same way for every service."""

from __future__ import annotations

from pathlib import Path

from loom.contracts.settings import Settings
from rollout_svc.rollout import base_policy
from zoo.registry import resolve_model_path
from zoo.search import (
    DEEP_CHECKPOINT_DIR,
    REFLECT_CHECKPOINT_DIR,
    SEARCH_CHECKPOINT_DIR,
    STREAM_CHECKPOINT_DIR,
)
from zoo.tiny import CHECKPOINT_DIR


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
