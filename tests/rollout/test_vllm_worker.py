"""The vLLM worker extension's checkpoint check (rollout_svc/engines/vllm_worker.py), run before a
reload touches the served model: pure functions of the files, tested here without vLLM; the
extension itself runs in tests/vllm_server. It must import with nothing but vLLM's own environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_svc.engines.vllm_worker import checkpoint_problem, safetensors_manifest
from tests.rollout.conftest import build_model_dir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("served") / "m", seed=0)


def test_the_same_model_with_other_weights_may_replace_it(served: Path, tmp_path: Path) -> None:
    other = build_model_dir(tmp_path / "m1", seed=1)
    assert checkpoint_problem(str(other), str(served)) is None
    manifest = safetensors_manifest(served)  # names and shapes, read from the file headers
    vocab = manifest["model.embed_tokens.weight"][0]
    assert manifest["lm_head.weight"] == (vocab, 32) and manifest["model.norm.weight"] == (32,)


def test_a_missing_or_empty_or_truncated_checkpoint_is_refused(served: Path, tmp_path: Path) -> None:
    assert "not a directory" in (checkpoint_problem(str(tmp_path / "nope"), str(served)) or "")
    (tmp_path / "empty").mkdir()
    assert "no *.safetensors" in (checkpoint_problem(str(tmp_path / "empty"), str(served)) or "")
    cut = build_model_dir(tmp_path / "cut", seed=2)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:-100])
    assert "truncated" in (checkpoint_problem(str(cut), str(served)) or "")
    (cut / "model.safetensors").write_bytes(b"\x00" * 4)
    assert "not a safetensors file" in (checkpoint_problem(str(cut), str(served)) or "")


def test_another_models_tensors_are_refused_naming_the_difference(served: Path, tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_json_file(str(served / "config.json"))
    cfg.intermediate_size = 48
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "narrow"))
    problem = checkpoint_problem(str(tmp_path / "narrow"), str(served)) or ""
    assert "mlp" in problem and "shape" in problem
    cfg = LlamaConfig.from_json_file(str(served / "config.json"))
    cfg.num_hidden_layers = 1
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path / "shallow"))
    assert "missing" in (checkpoint_problem(str(tmp_path / "shallow"), str(served)) or "")


def test_the_extension_imports_no_other_part_of_loom() -> None:
    # what vLLM does with --worker-extension-cls, in a bare interpreter with only the repository on
    # the path: the import must not need Loom's dependencies (pydantic settings, httpx, fastapi)
    code = (
        "import sys; import rollout_svc.engines.vllm_worker as w; "
        "assert hasattr(w, 'LoomWorkerExtension'); "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('loom', 'pydantic', 'pydantic_settings', 'httpx', 'fastapi', 'torch')); print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
