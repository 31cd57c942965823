"""Fixtures shared by the worker security tests (imported by name into each test module):

``engine_url`` (module): a real ``loom engine`` subprocess serving the built-in tiny model over vLLM's
protocol. Loom's vLLM client has no attention scores of its own, so tree mode's attention branching
calls a scorer there, as on the compose stack.
``rollout`` (function): the rollout service's app in-process on that engine, as ``(client, use)``;
``use(rollout=None, **settings)`` sets the operator's settings the app reads (the shared ones and the
rollout service's own, ``RolloutSettings``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loom.contracts.settings import Settings
from rollout_svc.config import RolloutSettings
from rollout_svc.engines import set_engine
from tests.rollout.conftest import start_engine_server, stop_process

Use = Callable[..., None]


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    proc, url = start_engine_server(["--model", "tiny"])
    try:
        yield url
    finally:
        stop_process(proc)


@pytest.fixture
def rollout(engine_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Use]]:
    from rollout_svc.api import app
    from rollout_svc.engines.vllm import VLLMEngine

    set_engine(VLLMEngine(engine_url, timeout=60, retries=0))
    saved = app.state.settings, app.state.rollout

    def use(rollout: RolloutSettings | None = None, **settings: Any) -> None:
        app.state.settings = Settings(data_dir=tmp_path / "data", **settings)
        app.state.rollout = rollout or RolloutSettings()

    use()
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, use
    finally:
        app.state.settings, app.state.rollout = saved
        set_engine(None)


def tree_request(**mode_params: Any) -> dict[str, Any]:
    """A tree group with attention branching (the strategy that needs a scorer)."""
    return {
        "prompt": "Compute 12+30. Think step by step.",
        "mode": "tree",
        "sampling": {"max_tokens": 24, "seed": 1},
        "mode_params": {"initial": 2, "strategy": "attention", "min_distance": 1, **mode_params},
    }
