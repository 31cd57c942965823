"""A small httpx client shared by every service client: base URL, API key, typed errors, retries."""

from __future__ import annotations

import time
from typing import Any

import httpx


class LoomHTTPError(RuntimeError):
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.body = body
        super().__init__(f"HTTP {status}: {body}")


class ServiceClient:
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
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
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

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
