"""What a replica loads for a published version, and what a failed load says (docs/security.md,
"Publishing policy versions"): the torch engine on a real small Llama, real peft adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from loom.contracts.wire import PolicyVersion
from rollout_svc.engines.base import PolicyLoadError
from tests.rollout.conftest import DEVICE, build_model_dir

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The deployment's base, and another key's private weights of the same shape."""
    tmp = tmp_path_factory.mktemp("models")
    return build_model_dir(tmp / "base", seed=0), build_model_dir(tmp / "private", seed=5)


def adapter_of(base: Path, folder: Path, names: str) -> Path:
    """A peft LoRA adapter of ``base`` (non-zero B, so merging changes the weights) whose config's
    ``base_model_name_or_path`` is ``names``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = peft.get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base)),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(str(folder))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": names}))
    return folder


def weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_lora_is_merged_into_the_deployments_base_whatever_its_config_names(
    tmp_path: Path, models: tuple[Path, Path]
) -> None:
    """An adapter naming another key's private checkpoint as its base got a model merged into those
    weights, and the field told which folders exist on the replica (``/etc`` loaded nothing, a missing
    path loaded the base)."""
    from rollout_svc.engines.torch.model import load_adapter

    base, private = models
    honest = weights(load_adapter(adapter_of(base, tmp_path / "a", str(base)), base))
    for i, named in enumerate((str(private), "/etc", "/no/such/folder")):
        got = weights(load_adapter(adapter_of(base, tmp_path / f"b{i}", named), base))
        assert got.keys() == honest.keys()
        assert all(torch.equal(got[k], honest[k]) for k in honest), named


@pytest.fixture(scope="module")
def engine(models: tuple[Path, Path]) -> Any:
    from rollout_svc.engines.torch import TorchEngine

    return TorchEngine(models[0], cache_entries=4, device=DEVICE)


def test_a_failed_load_names_the_version_never_the_store_path_and_is_always_typed(
    tmp_path: Path, models: tuple[Path, Path], engine: Any
) -> None:
    """Job errors carried ``PolicyLoadError: could not load policy '<data dir>/policy/ns/<key>/v3'``;
    a malformed safetensors file was a ``SafetensorError``, not a typed load failure; a config that
    declares a far larger model was allocated before anything failed."""
    base, _ = models
    cfg = json.loads((base / "config.json").read_text())
    store = tmp_path / "secret-data-dir" / "policy" / "ns" / "alice"
    cases: dict[str, Any] = {
        "missing": None,
        "broken": lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
        "inflated": lambda d: (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": 4096})),
        "another architecture": lambda d: (d / "config.json").write_text(
            json.dumps({**cfg, "model_type": "bert"})
        ),
    }
    for version, (what, change) in enumerate(cases.items(), start=3):
        folder = store / f"v{version}"
        if change is not None:
            shutil.copytree(base, folder)
            change(folder)
        policy = PolicyVersion(version=version, path=str(folder), namespace="alice")
        with pytest.raises(PolicyLoadError) as info:
            engine.load_policy_sync(policy)
        message = str(info.value)
        assert "secret-data-dir" not in message and str(tmp_path) not in message, (what, message)
        assert f"policy version {version} of namespace 'alice'" in message, (what, message)
        if what == "inflated":
            assert "hidden_size 4096" in message
        assert engine.policy_version == 0  # the base is still served
