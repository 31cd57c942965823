"""Typed client of the sandbox service (``sandbox_svc``): what the reward service's code rewards call.

The reward service reaches the sandbox over HTTP, not by importing it: model-written code runs only in
the sandbox tier's processes (docs/sandbox.md), whose admission control answers 429 ``busy`` when
full. ``run_batch`` sends runs in chunks, waits out a 429 (its Retry-After) up to ``busy_wait_s``, and
never raises: a run the sandbox could not take is that run's ``sandbox_error`` outcome, so one
unreachable sandbox fails no reward batch. The reward service passes ``LOOM_REWARD_SANDBOX_URL``; the
default is the settings' sandbox port.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx

from loom.clients.base import LoomHTTPError, ServiceClient
from loom.contracts.sandbox import MAX_BATCH, BatchResult, RunRequest, RunResult
from loom.contracts.settings import get_settings


def default_url() -> str:
    return get_settings().service_url("sandbox")


class SandboxClient(ServiceClient):
    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float = 300.0,
        retries: int = 2,
        chunk: int = 32,
        busy_wait_s: float = 120.0,
        **kw: Any,
    ) -> None:
        super().__init__(base_url or default_url(), timeout=timeout, retries=retries, **kw)
        self.chunk = max(1, min(chunk, MAX_BATCH))
        self.busy_wait_s = busy_wait_s

    def run(self, req: RunRequest) -> RunResult:
        return self.run_batch([req])[0]

    def run_batch(self, runs: Sequence[RunRequest]) -> list[RunResult]:
        """Every run's outcome, in order (``POST /v1/sandbox/batch`` per chunk)."""
        out: list[RunResult] = []
        for at in range(0, len(runs), self.chunk):
            out.extend(self._chunk(list(runs[at : at + self.chunk])))
        return out

    async def arun_batch(self, runs: Sequence[RunRequest]) -> list[RunResult]:
        """``run_batch`` off the event loop (the reward API awaits it beside its verifier pool)."""
        return await asyncio.to_thread(self.run_batch, runs)

    def _chunk(self, runs: list[RunRequest]) -> list[RunResult]:
        body = {"runs": [r.model_dump(mode="json") for r in runs]}
        give_up = time.monotonic() + self.busy_wait_s
        while True:
            try:
                data = self.post("/v1/sandbox/batch", json=body)
                return BatchResult.model_validate(data).results
            except LoomHTTPError as exc:
                if exc.status == 429 and time.monotonic() < give_up:
                    time.sleep(0.2)
                    continue
                why = f"sandbox answered {exc.status}: {str(exc)[:200]}"
            except httpx.HTTPError as exc:
                why = f"sandbox unreachable: {type(exc).__name__}: {str(exc)[:200]}"
            return [RunResult(status="sandbox_error", detail=why) for _ in runs]
