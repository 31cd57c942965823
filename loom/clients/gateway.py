"""Typed client of the gateway's public API (jobs and runs), used by ``loom demo`` and trainers."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from loom.clients.base import EventLines, LoomHTTPError, ServiceClient, response_body


class GatewayClient(ServiceClient):
    """``GatewayClient(url, api_key=...)``; bodies are the gateway's JSON contracts (gateway/models.py)."""

    # ---- jobs
    def submit_job(self, body: dict[str, Any]) -> str:
        """POST /v1/jobs (idempotent by ``body['job_key']``); returns the job id."""
        return str(self.post("/v1/jobs", json=body)["id"])

    def job(self, job_id: str, offset: int = 0, limit: int | None = None) -> dict[str, Any]:
        """GET /v1/jobs/{id}: the job and one page of its groups from ``offset`` (``next_offset`` names
        the next page; the gateway's default page when ``limit`` is None)."""
        params = {"offset": offset, **({} if limit is None else {"limit": limit})}
        return dict(self.get(f"/v1/jobs/{job_id}", params=params))

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        """POST /v1/jobs/{id}/cancel: nothing more of the job is generated or scored; its view."""
        return dict(self.post(f"/v1/jobs/{job_id}/cancel"))

    def wait_job(self, job_id: str, timeout: float = 600.0, poll: float = 0.5) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            view = self.job(job_id)
            if view["status"] in ("succeeded", "failed", "cancelled") or time.monotonic() > deadline:
                return view
            time.sleep(poll)

    def job_events(self, job_id: str, last_event_id: int | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of a job: ("group", ScoredGroup dict) ..., then ("end", status dict)."""
        for kind, _, data in self.job_events_with_ids(job_id, last_event_id):
            yield kind, data

    def job_events_with_ids(
        self, job_id: str, last_event_id: int | None = None
    ) -> Iterator[tuple[str, int | None, Any]]:
        """``job_events`` with each event's id (a group's sequence number; None for ``end``): give the
        last one seen as ``last_event_id`` to go on after a dropped connection."""
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                raise LoomHTTPError(r.status_code, response_body(r))
            events = EventLines()
            for line in r.iter_lines():
                if (event := events.feed(line)) is not None:
                    kind, event_id, data = event
                    yield kind, event_id if kind != "end" else None, data
                    if kind == "end":
                        return

    # ---- datasets and runs
    def upload_dataset(self, rows: Iterable[dict[str, Any]], chunk_rows: int = 1000) -> dict[str, Any]:
        """POST /v1/datasets: ``rows`` ({prompt, answer} dicts, any iterable: a file can be read
        lazily) streamed as JSONL; returns ``{"id", "n_items"}`` (a run's ``dataset: {"id": ...}``)."""

        def body() -> Iterator[bytes]:
            buf: list[str] = []
            for row in rows:
                buf.append(json.dumps(row) + "\n")
                if len(buf) >= chunk_rows:
                    yield "".join(buf).encode()
                    buf = []
            if buf:
                yield "".join(buf).encode()

        headers = {"Content-Type": "application/x-ndjson"}
        return dict(self.request("POST", "/v1/datasets", content=body(), headers=headers))

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
