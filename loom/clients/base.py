"""A small httpx client shared by every service client: base URL, API key, typed errors, retries."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loom.closing import Closing


class LoomHTTPError(RuntimeError):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {body}")


def response_body(r: httpx.Response) -> Any:
    """A response's body: its JSON where its content type says so, else its text."""
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


@dataclass
class EventLines:
    """A server-sent event stream read line by line: ``feed`` gives (event, id, data) at each
    ``data:`` line and forgets the event's name and id (an unnamed event is a "message")."""

    kind: str = "message"
    event_id: int | None = None

    def feed(self, line: str) -> tuple[str, int | None, Any] | None:
        if line.startswith("event: "):
            self.kind = line[7:]
        elif line.startswith("id: "):
            self.event_id = int(line[4:])
        elif line.startswith("data: "):
            event = (self.kind, self.event_id, json.loads(line[6:]))
            self.kind, self.event_id = "message", None
            return event
        return None


class ServiceClient(Closing):
    """Synchronous client; ``retries`` applies to connection errors and 502/503/504 only."""

    def __init__(
        self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0, retries: int = 2
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.retries = retries

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        delay = 0.2
        for attempt in range(self.retries + 1):
            try:
                r = self.http.request(method, path, **kwargs)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
                time.sleep(delay)
                delay *= 2
                continue
            if r.status_code in (502, 503, 504) and attempt < self.retries:
                time.sleep(delay)
                delay *= 2
                continue
            body = response_body(r)
            if r.status_code >= 400:
                raise LoomHTTPError(r.status_code, body)
            return body
        raise AssertionError("unreachable")

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, json: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", path, json=json, **kwargs)

    def close(self) -> None:
        self.http.close()
