"""Fixtures of the env tier's tests: the real sandbox's HTTP API (bubblewrap) for the python
environment, Loom's tiny checkpoint in the real torch engine for agent episodes. Nothing is mocked."""

from __future__ import annotations

import os
from collections.abc import Iterator
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
def sandbox_url() -> Iterator[str]:
    from sandbox_svc.runner import bwrap_path

    if bwrap_path() is None:
        pytest.skip("bubblewrap is not installed (deploy/setup.sh): the python environment needs the sandbox")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOM_SANDBOX_SESSIONS", "2")
    from sandbox_svc import api
    from sandbox_svc.config import get_sandbox_settings
    from tests.reflect.reflect_helpers import serve

    get_sandbox_settings.cache_clear()
    api._close_sessions()
    try:
        with serve(api.app) as url:
            yield url
    finally:
        api._close_pool()
        api._close_sessions()
        get_sandbox_settings.cache_clear()
        mp.undo()
