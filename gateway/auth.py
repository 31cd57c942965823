"""Authentication, scopes and per-key rate limits for every gateway route (one ASGI-level check).

401: no key or an unknown key. 403: a valid key without the route's scope. 429 + Retry-After: the
key's token bucket is empty, or the client address has failed authentication too often (its own
bucket, ``LOOM_GATEWAY_AUTH_FAIL_RATE``/``_BURST``: it is checked BEFORE a presented key is hashed, so
guessing keys costs a 429, not a key check). Only ``/healthz`` and ``/readyz`` are open (probes carry
no secrets). Behind a reverse proxy the client address is the proxy's unless uvicorn is told to trust
its ``X-Forwarded-For`` (``--proxy-headers --forwarded-allow-ips``; docs/security.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway.keys import KeyRing
from gateway.ratelimit import TokenBuckets, retry_after_header

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
ADMIN_PATHS = frozenset({"/metrics", "/v1/ping", "/v1/queues"})


def required_scope(path: str) -> str | None:
    """The scope a path needs (None: any valid key)."""
    if path in ADMIN_PATHS:
        return "admin"
    if path == "/v1/jobs" or path.startswith("/v1/jobs/"):
        return "jobs"
    if path == "/v1/runs" or path.startswith("/v1/runs/"):
        return "runs"
    return None


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return auth[7:].strip()
    return request.headers.get("x-api-key") or None


def _refuse(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": error, "detail": detail}, headers=headers)


def client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def auth_middleware(
    keys: KeyRing, buckets: TokenBuckets, failures: TokenBuckets
) -> Callable[..., Awaitable[Any]]:
    async def check(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        path = request.url.path
        if path in OPEN_PATHS:
            return await call_next(request)
        address = client_address(request)
        blocked = failures.wait(address)
        if blocked > 0:
            return _refuse(
                429,
                "rate_limited",
                "too many failed authentications from this address",
                {"Retry-After": retry_after_header(blocked)},
            )
        key = presented_key(request)
        found = None if key is None else keys.verify(key)
        if found is None:
            # no await between the check above and this: concurrent failures cannot all slip through
            failures.take(address)
            what = "missing API key" if key is None else "invalid API key"
            return _refuse(401, "unauthenticated", what, {"WWW-Authenticate": "Bearer"})
        scope = required_scope(path)
        if scope is not None and scope not in found.scopes and "admin" not in found.scopes:
            return _refuse(403, "forbidden", f"key {found.name!r} lacks the {scope!r} scope")
        wait = buckets.take(found.name)
        if wait > 0:
            return _refuse(
                429,
                "rate_limited",
                "too many requests for this key",
                {"Retry-After": retry_after_header(wait)},
            )
        request.state.key_name = found.name
        return await call_next(request)

    return check
