"""Engines: one token-in/token-out interface (``base.Engine``), two implementations.

``make_engine(settings)`` builds the configured one: ``vllm`` (a client of ``LOOM_ENGINE_URL``,
a vLLM server or ``loom engine``) or ``torch`` (in its own child process, ``ProcessEngine``, by
default; in the calling process with ``LOOM_ENGINE_PROCESS=false``). ``get_engine()`` keeps ONE engine per
process, so a rollout replica keeps its prefix cache (and its server affinity) across tasks.
"""

from __future__ import annotations

import asyncio
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily: vLLM's worker imports rollout_svc.engines.vllm_worker with its
    # own Python, which runs this file and must not need Loom's dependencies
    from loom.contracts.settings import Settings
    from rollout_svc.engines.base import Engine

_engine: Engine | None = None
_lock = threading.Lock()


def make_engine(settings: Settings) -> Engine:
    if settings.engine == "vllm" or settings.engine_url:
        if not settings.engine_url:
            raise ValueError("LOOM_ENGINE=vllm needs LOOM_ENGINE_URL")
        from rollout_svc.config import VllmSettings
        from rollout_svc.engines.vllm import VLLMEngine

        vllm = VllmSettings()

        return VLLMEngine(
            settings.engine_url,
            timeout=settings.engine_timeout_s,
            retries=settings.engine_retries,
            logprobs_mode=settings.engine_logprobs_mode,
            policy_store=settings.policy_local_root,  # vLLM loads pulled versions from the cache
            pause_mode=vllm.pause_mode,
            lora_keep=vllm.lora_keep,
        )
    from rollout_svc.engines.torch import TorchEngine, resolve_model_path

    path = resolve_model_path(settings.model)
    kwargs: dict[str, Any] = {
        "device": settings.device,
        "cache_entries": settings.engine_prefix_cache_entries,
        "logprobs_mode": settings.engine_logprobs_mode,
        "dtype": settings.engine_dtype,
        **lora_settings(),
    }
    if settings.engine_process:
        from rollout_svc.engines.process import ProcessEngine

        return ProcessEngine(path, timeout_s=settings.engine_timeout_s, **kwargs)
    return TorchEngine(path, **kwargs)


def lora_settings() -> dict[str, int]:
    """The torch engine's LRU bounds (``LOOM_ROLLOUT_TORCH_MAX_LORAS``, ``_LORA_BYTES``,
    ``_VERSIONS_BYTES``: rollout_svc/config.py)."""
    from rollout_svc.config import get_rollout_settings

    rollout = get_rollout_settings()
    return {
        "max_loras": rollout.torch_max_loras,
        "lora_bytes": rollout.torch_lora_bytes,
        "versions_bytes": rollout.torch_versions_bytes,
    }


def get_engine(settings: Settings | None = None) -> Engine:
    from loom.contracts.settings import get_settings

    global _engine
    with _lock:
        if _engine is None:
            _engine = make_engine(settings or get_settings())
        return _engine


async def get_engine_async(settings: Settings | None = None) -> Engine:
    """``get_engine`` for an event loop: the first call builds the engine (seconds: a model load, or
    the start of the torch engine's process) in a thread; later calls return it at once."""
    engine = _engine
    if engine is not None:
        return engine
    return await asyncio.to_thread(get_engine, settings)


def set_engine(engine: Engine | None) -> None:
    """Install (or drop) the process engine; used by tests and benchmarks."""
    global _engine
    with _lock:
        _engine = engine


_tokenizer: object | None = None


def get_tokenizer(settings: Settings | None = None) -> object:
    """The tokenizer of the served model: the torch engine's own, else loaded from ``LOOM_MODEL``."""
    global _tokenizer
    engine_tok = getattr(_engine, "tokenizer", None)
    if engine_tok is not None:
        return engine_tok
    with _lock:
        if _tokenizer is None:
            from loom.contracts.settings import get_settings
            from rollout_svc.engines.torch import load_tokenizer, resolve_model_path

            _tokenizer = load_tokenizer(resolve_model_path((settings or get_settings()).model))
        return _tokenizer
