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
event streams and JSON answer 401. A key holds at most ``LOOM_GATEWAY_SESSIONS_PER_KEY`` sessions (its
own oldest goes, never another key's) and logs in at most ``LOOM_GATEWAY_LOGIN_RATE``/``_BURST`` times,
per key and per client address; a login must come from the gateway's own form (its Origin or Referer,
and the form's token: docs/security.md, "The run page's sessions and logins").
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse, RedirectResponse

from gateway.config import GatewaySettings
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


@dataclass(frozen=True)
class Session:
    key: ApiKey
    expires: float


class Sessions:
    """Random session ids -> the key that logged in, in this process's memory (a restart logs out).

    A key holds at most ``per_key`` sessions: its new login drops its own oldest, never another key's,
    so no key can log another out and memory stays bounded by (configured keys) x ``per_key``."""

    def __init__(self, per_key: int, ttl: float = SESSION_TTL_S) -> None:
        if per_key < 1:
            raise ValueError("per_key must be >= 1")
        self.per_key, self.ttl = per_key, ttl
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[str, dict[str, None]] = {}  # key name -> its session ids, oldest first
        self._lock = threading.Lock()

    def create(self, key: ApiKey) -> str:
        sid = secrets.token_urlsafe(32)
        now = time.monotonic()
        with self._lock:
            mine = self._by_key.get(key.name, {})
            # one ttl for all: a key's expired sessions are its oldest
            while mine and (self._by_id[next(iter(mine))].expires < now or len(mine) >= self.per_key):
                self._forget(next(iter(mine)))
            self._by_key.setdefault(key.name, {})[sid] = None
            self._by_id[sid] = Session(key, now + self.ttl)
        return sid

    def get(self, sid: str | None) -> ApiKey | None:
        if not sid:
            return None
        with self._lock:
            found = self._by_id.get(sid)
            if found is None:
                return None
            if found.expires < time.monotonic():
                self._forget(sid)
                return None
            return found.key

    def drop(self, sid: str | None) -> None:
        with self._lock:
            self._forget(sid or "")

    def count(self, name: str) -> int:
        """The sessions key ``name`` holds (expired ones included until its next login drops them)."""
        with self._lock:
            return len(self._by_key.get(name, ()))

    def _forget(self, sid: str) -> None:
        found = self._by_id.pop(sid, None)
        if found is None:
            return
        mine = self._by_key[found.key.name]
        del mine[sid]
        if not mine:
            del self._by_key[found.key.name]


@dataclass(frozen=True)
class Refused:
    """A login that made no session: its status, the sentence for the form, seconds to wait (429)."""

    status: int
    error: str
    wait: float = 0.0


@dataclass
class WebAuth:
    """What the run page's login and logout routes need (``request.state.web_auth`` on /ui paths)."""

    keys: KeyRing
    sessions: Sessions
    failures: TokenBuckets  # failed authentications per client address, shared with the API
    logins_by_key: TokenBuckets
    logins_by_address: TokenBuckets
    origins: frozenset[str] = frozenset()  # more origins the form may be posted from (a proxy's)

    @classmethod
    def from_settings(cls, keys: KeyRing, failures: TokenBuckets, config: GatewaySettings) -> WebAuth:
        rate, burst = config.login_rate, config.login_burst
        return cls(
            keys,
            Sessions(config.sessions_per_key),
            failures,
            TokenBuckets(rate, burst),
            TokenBuckets(rate, burst),
            frozenset(o.strip().rstrip("/").lower() for o in config.ui_origins.split(",") if o.strip()),
        )

    def login(self, request: Request, presented: str) -> str | Refused:
        """A new session id for a known key, else why not. Every attempt pays the address's login
        bucket; a wrong key also pays its failed-authentication bucket (checked first, before any key is
        hashed); a right key pays its own login bucket."""
        address = client_address(request)
        blocked = self.failures.wait(address)
        if blocked > 0:
            return Refused(429, "too many failed logins from this address; wait a minute", blocked)
        wait = self.logins_by_address.take(address)
        if wait > 0:
            return Refused(429, "too many logins from this address; wait a minute", wait)
        found = self.keys.verify(presented) if presented else None
        if found is None:
            self.failures.take(address)
            return Refused(401, "unknown API key")
        wait = self.logins_by_key.take(found.name)
        if wait > 0:
            return Refused(429, "too many logins with this key; wait a minute", wait)
        self.sessions.drop(request.cookies.get(SESSION_COOKIE))  # a browser's new login replaces its old
        return self.sessions.create(found)

    def from_own_page(self, request: Request) -> bool:
        """Whether a login post may come from this gateway's own form: its ``Origin`` (else its
        ``Referer``) names this gateway's host (the request's ``Host``) or one of ``origins``. Browsers
        send ``Origin`` on every POST; a client that sends neither is no browser tricked by another site
        and passes on to the form token check (gateway/routes/web.py)."""
        source = request.headers.get("origin") or request.headers.get("referer")
        if source is None:
            return True
        parts = urlsplit(source.strip().lower())
        if parts.scheme not in ("http", "https") or not parts.netloc:
            return False  # "null" (a sandboxed frame, a data: URL) and the like
        host = request.headers.get("host", "").strip().lower()
        return parts.netloc == host or f"{parts.scheme}://{parts.netloc}" in self.origins


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
    keys: KeyRing, buckets: TokenBuckets, failures: TokenBuckets, web: WebAuth
) -> Callable[..., Awaitable[Any]]:
    """The check; ``web`` holds the run page's sessions and login limits (``WebAuth.from_settings``)."""

    async def check(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        path = request.url.path
        if path in OPEN_PATHS:
            return await call_next(request)
        if is_ui(path):
            web_auth = request.state.web_auth = web
            if path in UI_OPEN_PATHS or path.startswith(UI_STATIC):
                return await call_next(request)
            if presented_key(request) is None:  # a browser: its session, or the login form
                found_key = web_auth.sessions.get(request.cookies.get(SESSION_COOKIE))
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
