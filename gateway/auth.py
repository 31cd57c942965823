"""Authentication, scopes and per-key rate limits for every gateway route (one ASGI-level check).

401: no key or an unknown key. 403: a valid key without the route's scope. 429 + Retry-After: the
key's token bucket is empty, or the client address has failed authentication too often (its own
bucket, ``LOOM_GATEWAY_AUTH_FAIL_RATE``/``_BURST``: it is checked BEFORE a presented key is hashed, so
guessing keys costs a 429, not a key check). Only ``/healthz`` and ``/readyz`` are open (probes carry
no secrets). Behind a reverse proxy the client address is the proxy's unless uvicorn is told to trust
its ``X-Forwarded-For`` (``--proxy-headers --forwarded-allow-ips``; docs/security.md).

The run page (``/ui``, gateway/routes/web.py) also takes a session: ``POST /ui/login`` with the key in a
form sets an HttpOnly, SameSite=Strict cookie holding a random session id that this process maps to
the key's name and scopes (the key itself is never stored or put in a URL). A session counts only on
``/ui`` paths, never on the ``/v1`` API; a ``/ui`` page without one redirects to the login form, its
event streams and JSON answer 401.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, RedirectResponse

from gateway.keys import ApiKey, KeyRing
from gateway.ratelimit import TokenBuckets, retry_after_header

OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# the name of the key a request came with, for checks below the route (gateway/validate.py: a job may
# name only its own key's policy namespace)
KEY_NAME: ContextVar[str | None] = ContextVar("loom_key_name", default=None)
ADMIN_PATHS = frozenset({"/metrics", "/v1/ping", "/v1/queues"})
UI_PREFIX = "/ui"
UI_OPEN_PATHS = frozenset({"/ui/login"})  # the form itself, and the vendored script and style below
UI_STATIC = "/ui/static/"
SESSION_COOKIE = "loom_session"
SESSION_TTL_S = 8 * 3600.0
MAX_SESSIONS = 10_000  # the oldest is dropped beyond: memory stays bounded whatever logs in


@dataclass(frozen=True)
class Session:
    key: ApiKey
    expires: float


class Sessions:
    """Random session ids -> the key that logged in, in this process's memory (a restart logs out)."""

    def __init__(self, ttl: float = SESSION_TTL_S, limit: int = MAX_SESSIONS) -> None:
        self.ttl, self.limit = ttl, limit
        self._by_id: dict[str, Session] = {}
        self._lock = threading.Lock()

    def create(self, key: ApiKey) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            while len(self._by_id) >= self.limit:
                del self._by_id[next(iter(self._by_id))]
            self._by_id[sid] = Session(key, time.monotonic() + self.ttl)
        return sid

    def get(self, sid: str | None) -> ApiKey | None:
        if not sid:
            return None
        with self._lock:
            found = self._by_id.get(sid)
            if found is None:
                return None
            if found.expires < time.monotonic():
                del self._by_id[sid]
                return None
            return found.key

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._by_id.pop(sid or "", None)


@dataclass
class WebAuth:
    """What the run page's login and logout routes need (``request.state.web_auth`` on /ui paths)."""

    keys: KeyRing
    sessions: Sessions
    failures: TokenBuckets

    def login(self, request: Request, presented: str) -> tuple[str | None, float]:
        """(a new session id, 0) for a known key; (None, seconds to wait) when this address is over its
        failed-authentication budget; (None, 0) for a wrong key (counted as a failure)."""
        address = client_address(request)
        blocked = self.failures.wait(address)
        if blocked > 0:
            return None, blocked
        found = self.keys.verify(presented) if presented else None
        if found is None:
            self.failures.take(address)
            return None, 0.0
        return self.sessions.create(found), 0.0


def is_ui(path: str) -> bool:
    return path == UI_PREFIX or path.startswith(UI_PREFIX + "/")


def wants_page(request: Request) -> bool:
    """A /ui request that a browser navigates to (HTML), not its event stream or JSON."""
    return request.method == "GET" and not request.url.path.endswith(("/events", ".json"))


def required_scope(path: str) -> str | None:
    """The scope a path needs (None: any valid key)."""
    if path in ADMIN_PATHS:
        return "admin"
    if path == "/v1/jobs" or path.startswith("/v1/jobs/"):
        return "jobs"
    if path in ("/v1/runs", "/v1/datasets") or path.startswith(("/v1/runs/", "/v1/datasets/")):
        return "runs"  # datasets exist for runs: a jobs-only key stores none
    if path == "/v1/policies" or path.startswith("/v1/policies/"):
        return "policy"
    if path.startswith(("/ui/jobs/", "/ui/runs/")):
        return path.split("/")[2]
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
    keys: KeyRing, buckets: TokenBuckets, failures: TokenBuckets, sessions: Sessions | None = None
) -> Callable[..., Awaitable[Any]]:
    web = WebAuth(keys, sessions or Sessions(), failures)

    async def check(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        path = request.url.path
        if path in OPEN_PATHS:
            return await call_next(request)
        if is_ui(path):
            request.state.web_auth = web
            if path in UI_OPEN_PATHS or path.startswith(UI_STATIC):
                return await call_next(request)
            if presented_key(request) is None:  # a browser: its session, or the login form
                found_key = web.sessions.get(request.cookies.get(SESSION_COOKIE))
                if found_key is None:
                    if wants_page(request):
                        return RedirectResponse("/ui/login", status_code=303)
                    return _refuse(401, "unauthenticated", "no session: log in at /ui/login")
                return await _admitted(request, call_next, found_key, buckets)
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
        return await _admitted(request, call_next, found, buckets)

    return check


async def _admitted(
    request: Request, call_next: Callable[[Request], Awaitable[Any]], found: ApiKey, buckets: TokenBuckets
) -> Any:
    """The scope and rate checks of an authenticated request, then the route."""
    scope = required_scope(request.url.path)
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
    KEY_NAME.set(found.name)
    request.state.key_scopes = found.scopes
    return await call_next(request)
