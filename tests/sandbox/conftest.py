"""The sandbox service as it is deployed: its FastAPI app under uvicorn on 127.0.0.1, in a thread of
the test process (``sandbox_url``), with a small pool (``LOOM_SANDBOX_SLOTS`` 2, queue 4)
and two interpreter sessions at most."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandbox_svc.runner import bwrap_path
from tests.reflect.reflect_helpers import serve


@pytest.fixture(scope="session")
def sandbox_url() -> Iterator[str]:
    if bwrap_path() is None:
        pytest.skip("bubblewrap is not installed (deploy/setup.sh)")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOOM_SANDBOX_SLOTS", "2")
    mp.setenv("LOOM_SANDBOX_QUEUE", "4")
    mp.setenv("LOOM_SANDBOX_SESSIONS", "2")
    from sandbox_svc import api
    from sandbox_svc.config import get_sandbox_settings

    get_sandbox_settings.cache_clear()
    api._close_pool()
    api._close_sessions()
    try:
        with serve(api.app) as url:
            yield url
    finally:
        api._close_pool()
        api._close_sessions()
        get_sandbox_settings.cache_clear()
        mp.undo()
