"""Typed client of the gateway's public API (jobs and runs), used by ``loom demo`` and trainers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from loom.clients.base import ServiceClient


class GatewayClient(ServiceClient):
    """``GatewayClient(url, api_key=...)``; bodies are the gateway's JSON contracts (gateway/models.py)."""

    # ---- jobs
    def submit_job(self, body: dict[str, Any]) -> str:
        """POST /v1/jobs (idempotent by ``body['job_key']``); returns the job id."""
        return str(self.post("/v1/jobs", json=body)["id"])

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{job_id}"))

    def wait_job(self, job_id: str, timeout: float = 600.0, poll: float = 0.5) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.job(job_id)
            if view["status"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
                return view
            time.sleep(poll)

    def job_events(self, job_id: str, last_event_id: int | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of a job: ("group", ScoredGroup dict) ..., then ("end", status dict)."""
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=None) as r:
            r.raise_for_status()
            kind = "message"
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    yield kind, json.loads(line[6:])
                    if kind == "end":
                        return

    # ---- runs
    def start_run(self, body: dict[str, Any]) -> str:
        """POST /v1/runs (idempotent by ``body['run_key']`` when given); returns the run id."""
        return str(self.post("/v1/runs", json=body)["id"])

    def run(self, run_id: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/runs/{run_id}"))

    def run_metrics(self, run_id: str, after: int = -1) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/runs/{run_id}/metrics", params={"after": after}))

    def cancel_run(self, run_id: str) -> dict[str, Any]:
        return dict(self.post(f"/v1/runs/{run_id}/cancel"))

    def follow_run(self, run_id: str, poll: float = 1.0) -> Iterator[dict[str, Any]]:
        """Yield each step's metrics as it completes, until the run ends."""
        after = -1
        while True:
            for m in self.run_metrics(run_id, after):
                after = int(m["step"])
                yield m
            if self.run(run_id)["status"] in ("succeeded", "failed", "cancelled"):
                for m in self.run_metrics(run_id, after):
                    yield m
                return
            time.sleep(poll)
