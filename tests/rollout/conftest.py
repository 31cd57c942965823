"""Fixtures of the rollout tests: a real small HF model on disk, the in-process torch engine, a
``loom engine`` subprocess serving the same checkpoint, and the vllm client pointed at it.

``engine`` is parametrized ``[torch, vllm]``: every test that takes it runs once on the torch engine
in-process and once through the vLLM protocol client against ``loom engine``.

``LOOM_TEST_DEVICE`` (default ``cpu``) is the device of these engines: ``LOOM_TEST_DEVICE=cuda`` runs
the same contract on a GPU host (the reference pass then runs on the engine's own weights there).
"""

from __future__ import annotations

import asyncio
import os
import socket
import string
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from loom.formats import DEFAULT_MARKERS

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A real, small Hugging Face causal LM with random weights and a real fast tokenizer (character-level
# vocabulary plus Loom's markers as special tokens), saved to disk and loaded with from_pretrained
# exactly like any checkpoint. Not a mock.
SPECIALS = ["<pad>", "<unk>", "</s>", *DEFAULT_MARKERS.special_tokens()]
CHARS = list(string.ascii_lowercase + string.digits + " .,?+-*/=()")


def build_model_dir(path: Path, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a livelier random model: larger logits, so sampling is not uniform
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from loom.runtime import configure_process

    configure_process()
    return build_model_dir(tmp_path_factory.mktemp("model") / "random-llama")


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


@pytest.fixture(scope="session")
def torch_engine(model_dir: Path) -> Any:
    from rollout_svc.engines.torch import TorchEngine

    return TorchEngine(model_dir, cache_entries=16, device=DEVICE)


@pytest.fixture(scope="session")
def reference_model(torch_engine: Any) -> Any:
    """The weights the reference (teacher-forced) pass uses: loaded from the same directory."""
    return torch_engine.model


def start_engine_server(
    args: list[str], env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {
        **os.environ,
        "LOOM_TORCH_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        # the control routes Loom's vllm client uses exist only with these, as on vLLM (docs/vllm.md)
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        **(env_extra or {}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "engine", "--port", str(port), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loom engine exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    stop_process(proc)
    raise RuntimeError("loom engine did not become healthy in 90 s")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="session")
def engine_server(model_dir: Path) -> Iterator[str]:
    proc, url = start_engine_server(["--model", str(model_dir), "--device", DEVICE])
    try:
        yield url
    finally:
        stop_process(proc)


@pytest.fixture(scope="session")
def vllm_engine(engine_server: str, arun: Any) -> Iterator[Any]:
    from rollout_svc.engines.vllm import VLLMEngine

    engine = VLLMEngine(engine_server, timeout=60, retries=2)
    yield engine
    arun(engine.close())


@pytest.fixture(scope="session")
def process_engine(model_dir: Path) -> Iterator[Any]:
    """The torch engine in its own process (the default LOOM_ENGINE_PROCESS=true)."""
    from rollout_svc.engines.process import ProcessEngine

    engine = ProcessEngine(model_dir, cache_entries=16, device=DEVICE)
    yield engine
    engine.close_sync()


@pytest.fixture(params=["torch", "process", "vllm"])
def engine(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(params=["torch", "process"])
def local_engine(request: pytest.FixtureRequest) -> Any:
    """The torch engine in-process and in its own process: the group-layout capability."""
    return request.getfixturevalue(f"{request.param}_engine")


@pytest.fixture(scope="session")
def tokenizer(torch_engine: Any) -> Any:
    return torch_engine.tokenizer
