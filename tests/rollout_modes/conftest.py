"""Fixtures of the tree/spawn mode tests: Loom's tiny checkpoint in the real torch engine, and a small
random-weight Llama (grouped-query attention) for the FCI scorer. Nothing is mocked.

``LOOM_TEST_DEVICE`` (default ``cpu``) is the tiny engine's device: ``cuda`` on a GPU host."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from loom.runtime import configure_process


@pytest.fixture(scope="session")
def tiny_engine() -> Any:
    configure_process()
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR

    return TorchEngine(CHECKPOINT_DIR, cache_entries=64, device=os.environ.get("LOOM_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    configure_process()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    path = Path(tmp_path_factory.mktemp("llama")) / "m"
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return LlamaForCausalLM.from_pretrained(str(path), attn_implementation="sdpa").eval()
