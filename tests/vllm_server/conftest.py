"""The real-vLLM test layer: one vLLM 0.32 server (CPU build, ``deploy/vllm-setup.sh``) per test run,
serving Loom's tiny model (``zoo/tiny/checkpoint``, tied embeddings) the way docs/vllm.md says to.

``vllm`` (session) is the server's handle: ``vllm.url``; ``vllm.ensure(logprobs_mode, dev=True)``
restarts it when a test needs another configuration (the log-prob mode is a server flag), on the same
port, so at most one vLLM process runs at any time; ``vllm.restart()`` kills and starts it again.
The whole layer is skipped, with the reason, only when the vLLM environment does not exist
(``LOOM_VLLM_PYTHON``, else ``.venv-vllm/bin/python``). A test that starts the server waits for its
``/health`` (up to ``START_S``), so each test here gets a pytest timeout past that wait.

Helpers: ``full_and_lora`` (session): a policy store with a full version 1 (a changed copy of the tiny
model) and a LoRA version 2;
``reference_logprobs(path, prompt, completion, temperature)``: the learner's own recomputation
(``learner.logprobs.recompute``) with the HF model at ``path``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest

from zoo.tiny import CHECKPOINT_DIR

T = TypeVar("T")
TINY = Path(CHECKPOINT_DIR)
SERVED = "tiny"


def _python() -> Path:
    from rollout_svc.config import VllmSettings
    from rollout_svc.engines.vllm_launch import vllm_python

    return vllm_python(VllmSettings().python)


# a test may pay for a server (re)start, which waits up to START_S for /health (minutes on a loaded
# machine): pytest-timeout's default (300 s) would cut it; each layer's test gets this much instead
START_S = 600
TEST_TIMEOUT_S = START_S + 300


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    py = _python()
    skip = pytest.mark.skip(
        reason=f"no vLLM environment at {py}: run `bash deploy/vllm-setup.sh` (docs/vllm.md)"
    )
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        if not py.exists():
            item.add_marker(skip)
        elif item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT_S))
    # fewer server starts (~40 s each on a loaded machine): the one test module that needs
    # ``--logprobs-mode processed`` goes last in the layer, after the restart tests' own servers
    layer = [i for i in items if here in Path(str(i.fspath)).parents]
    if layer:
        processed = [i for i in layer if Path(str(i.fspath)).name == "test_logprobs_processed.py"]
        rest = [i for i in layer if i not in processed]
        at = items.index(layer[0])
        others = [i for i in items if here not in Path(str(i.fspath)).parents]
        items[:] = others[:at] + rest + processed + others[at:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLM:
    """The test run's one vLLM server (module docstring)."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.server: Any = None
        self.config: tuple[str, bool] | None = None
        self.starts = 0

    def ensure(self, logprobs_mode: Literal["raw", "processed"] = "raw", dev: bool = True) -> str:
        if self.config != (logprobs_mode, dev) or self.server is None:
            self.start(logprobs_mode, dev)
        return self.url

    def start(self, logprobs_mode: Literal["raw", "processed"] = "raw", dev: bool = True) -> None:
        from rollout_svc.engines.vllm_launch import VLLMServer, vllm_command, vllm_env

        self.stop()
        cmd = vllm_command(
            _python(), TINY, self.port, served_name=SERVED, logprobs_mode=logprobs_mode, lora_rank=8
        )
        env = vllm_env()
        if not dev:  # no dev routes (vLLM's default); runtime LoRA updating stays on
            env.pop("VLLM_SERVER_DEV_MODE")
        self.starts += 1
        self.server = VLLMServer(cmd, env, self.log_dir / f"vllm-{self.starts}.log").start(timeout_s=START_S)
        self.config = (logprobs_mode, dev)

    def restart(self) -> None:
        mode, dev = self.config or ("raw", True)
        self.start(mode, dev)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
            self.config = None


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLM]:
    server = VLLM(tmp_path_factory.mktemp("vllm-logs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="session")
def arun(loop: asyncio.AbstractEventLoop) -> Any:
    def run(coro: Coroutine[Any, Any, T]) -> T:
        return loop.run_until_complete(coro)

    return run


def changed_checkpoint(out: Path, seed: int, scale: float = 0.05) -> Path:
    """The tiny model with every weight moved by N(0, scale) noise, saved as the learner saves (tied
    embeddings: no lm_head tensor in the file)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(TINY / name, out / name)
    return out


def write_lora(out: Path, seed: int, rank: int = 8, alpha: int = 16) -> dict[str, Any]:
    """A LoRA adapter of the tiny model in PEFT's on-disk format (adapter_config.json +
    adapter_model.safetensors, q_proj and v_proj of every layer); returns module -> (A, B, scale)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    cfg = json.loads((TINY / "config.json").read_text())
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    tensors, parts = {}, {}
    for i in range(layers):
        for proj in ("q_proj", "v_proj"):
            a = torch.randn(rank, hidden, generator=g) * 0.1
            b = torch.randn(hidden, rank, generator=g) * 0.1
            key = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            parts[f"model.layers.{i}.self_attn.{proj}"] = (a, b, alpha / rank)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(TINY),
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return parts


_models: dict[str, Any] = {}


def hf_model(path: Path | str, lora: dict[str, Any] | None = None) -> Any:
    """The HF model at ``path`` (with ``lora`` merged into its weights: W + scale * B A)."""
    import torch
    from transformers import AutoModelForCausalLM

    key = f"{path}|{id(lora) if lora else ''}"
    if key not in _models:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            for name, (a, b, scale) in (lora or {}).items():
                model.get_submodule(name).weight.add_(scale * (b @ a))
        _models[key] = model
    return _models[key]


def reference_logprobs(
    path: Path | str,
    prompt_ids: list[int],
    completion_ids: list[int],
    temperature: float = 1.0,
    lora: dict[str, Any] | None = None,
) -> list[float]:
    """The learner's recomputation (learner.logprobs.recompute) of a completion's log-probs."""
    import torch

    from learner.logprobs import recompute
    from loom.contracts.wire import Trajectory

    t = Trajectory(id="r", group_id="g", prompt_ids=prompt_ids, completion_ids=completion_ids)
    with torch.no_grad():
        (mb,) = recompute(hf_model(path, lora), [t], temperature=temperature)
    return [float(x) for x in mb.logp[0, : len(completion_ids)]]


def max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="session")
def full_and_lora(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A policy store holding a full version 1 (a changed copy of the tiny model) and a LoRA version 2."""
    from loom.store import PolicyStore

    s = PolicyStore(tmp_path_factory.mktemp("full-and-lora"))
    s.publish(1, lambda d: changed_checkpoint(d, seed=21) and None)
    s.publish(2, lambda d: write_lora(d, seed=22) and None, kind="lora")
    return s


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from zoo.tiny import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def prompt_ids(tokenizer: Any) -> list[int]:
    from zoo.tiny import make_problems, plain_prompt

    prob = make_problems("arith", 1, seed=11)[0]
    return list(tokenizer.encode(plain_prompt(prob), add_special_tokens=False))
