"""Fixtures of the reflect tests: the tiny tokenizer and the real services served over HTTP in
threads (uvicorn): the rollout API (torch engine, tiny model), the reward API (isolated verifier pool),
``loom engine`` (the tiny model behind the vLLM protocol) and the reflect API over the first two.
Every server is stopped at teardown.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reflect_helpers import serve  # noqa: E402

from loom.runtime import configure_process  # noqa: E402

configure_process()


@pytest.fixture(scope="session")
def tok() -> Any:
    from zoo.tiny import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def reward_url() -> Iterator[str]:
    from reward_svc.api import app

    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def rollout_url() -> Iterator[str]:
    from rollout_svc.api import app

    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    """``loom engine``'s app serving the tiny model (vLLM's OpenAI-compatible completions)."""
    from rollout_svc.engines.server import create_engine_app
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR)
    with serve(create_engine_app(engine, "tiny", engine.tokenizer)) as url:
        yield url


@pytest.fixture(scope="module")
def reflect_url(rollout_url: str, reward_url: str) -> Iterator[str]:
    """The reflect API over HTTP, reaching the rollout and reward APIs above over HTTP."""
    import os

    from loom.contracts.settings import get_settings
    from reflect_svc.config import get_reflect_settings

    saved = {
        k: os.environ.get(k)
        for k in ("LOOM_REFLECT_TRANSPORT", "LOOM_REFLECT_ROLLOUT_URL", "LOOM_REFLECT_REWARD_URL")
    }
    os.environ.update(
        LOOM_REFLECT_TRANSPORT="http",
        LOOM_REFLECT_ROLLOUT_URL=rollout_url,
        LOOM_REFLECT_REWARD_URL=reward_url,
    )
    get_reflect_settings.cache_clear()
    get_settings.cache_clear()
    from reflect_svc.api import app

    try:
        with serve(app) as url:
            yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_reflect_settings.cache_clear()
