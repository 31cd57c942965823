"""What every service's FastAPI app has in common.

``create_app(service)`` gives: ``/healthz`` (process alive), ``/readyz`` (broker and the service's own
dependencies), ``/metrics`` (Prometheus text), ``/version``; request-body size limit (413); validation
errors as 422 with the field path; any unhandled error as a typed 500 body without a stack trace.
Services add their routes to the returned app and stay thin. ``create_queue_app(service, celery_app)``,
for the services in front of Celery workers (all five), adds the broker to ``/readyz`` and
``POST /v1/ping``.

Every error body has one shape, ``ErrorBody`` (loom.contracts.errors): ``{"error": <kind>,
"detail": <text or the list of problems>, ...}`` (never ``detail.detail``), and every route's OpenAPI
lists the error statuses it can answer with that schema (docs/security.md). A JSON body that is not
UTF-8 or nests deeper than the parser goes is a 422 at ``body`` naming the problem; a dependency that
is down (broker, result store) is a 503 ``dependency_unavailable``, not a 500.

``serve(app, host, port)`` runs an app under uvicorn with read deadlines on each request's headers
and body (``http_protocol``: slow clients are closed, docs/security.md "Read timeouts"); ``loom api``
starts every service with it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loom import __version__
from loom.contracts.errors import ErrorBody
from loom.contracts.settings import Settings, get_settings
from loom.contracts.wire import SCHEMA_VERSION, Contract, VersionInfo
from loom.runtime import configure_process
from loom.service_token import UNAUTHORIZED, internal_route_guard

log = logging.getLogger("loom.service")

# A readiness check returns (ok, detail). It may be sync or async.
ReadyCheck = Callable[[], "tuple[bool, str] | Awaitable[tuple[bool, str]]"]


class BodyTooLarge(Exception):
    pass


# ------------------------------------------------------------------------------------------ errors


ERROR_TEXT: dict[int, str] = {
    400: "The request could not be read",
    401: "No API key, or an unknown one",
    403: "The API key lacks the route's scope",
    404: "Not found (or owned by another API key)",
    405: "Method not allowed",
    409: "The idempotency key names other work",
    413: "The request body is too large",
    422: "Invalid request: the problems, each with its field path",
    429: "Too many requests, or over a quota: retry after Retry-After seconds",
    500: "A bug of this service (the detail is a reference to its log)",
    503: "A dependency (broker, result store, engine) is unavailable: retry later",
    504: "A dependency did not answer in time",
}
ERROR_KINDS: dict[int, str] = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "validation_error",
    429: "rate_limited",
    503: "dependency_unavailable",
    504: "timeout",
}
COMMON_ERRORS: tuple[int, ...] = (400, 413, 422, 500, 503)


def error_responses(statuses: Iterable[int]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries: ``ErrorBody`` for each status."""
    return {s: {"model": ErrorBody, "description": ERROR_TEXT.get(s, "Error")} for s in sorted(set(statuses))}


def error_body(status: int, detail: Any) -> dict[str, Any]:
    """An HTTPException's detail as an ``ErrorBody``: a route's own typed dict is kept as it is (flat),
    anything else becomes ``{"error": <kind of the status>, "detail": ...}``."""
    if isinstance(detail, dict) and isinstance(detail.get("error"), str):
        return {"detail": detail.get("detail", detail["error"]), **detail}
    if not isinstance(detail, str | list):
        detail = str(detail)
    return {"error": ERROR_KINDS.get(status, "http_error"), "detail": detail}


# A dependency that is down (not a bug): 503 with Retry-After. Imported lazily: not every process that
# imports this module has a broker client loaded yet.
def _dependency_down(exc: BaseException) -> str | None:
    from kombu.exceptions import OperationalError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, OperationalError):
        return "the broker is unreachable"
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return "the result store is unreachable"
    return None


# ------------------------------------------------------------------------------------------ bodies

JSON_NESTING_ERROR = "the body nests deeper than this server parses"


def parse_json_body(body: bytes) -> Any:
    """``json.loads`` with the two failures it reports badly turned into decode errors at ``body``:
    bytes that are not UTF-8 (RFC 8259 8.1; ``json.loads`` would guess UTF-16/32 or raise
    UnicodeDecodeError, a 400 without a field) and nesting deep enough to exhaust the parser's
    recursion (a RecursionError)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        msg = f"the body is not valid UTF-8 (byte {exc.start}: {exc.reason})"
        raise json.JSONDecodeError(msg, "", exc.start) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(JSON_NESTING_ERROR, "", 0) from None


class LoomRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class LoomRoute(APIRoute):
    """Routes whose JSON bodies are parsed by ``parse_json_body`` (FastAPI's custom-route hook)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def loom_handler(request: Request) -> Response:
            return await handler(LoomRequest(request.scope, request.receive))

        return loom_handler


class BodySizeLimit:
    """Refuse bodies over ``limit`` bytes (``limits[path]`` on the paths named there) with 413, by
    Content-Length or while streaming."""

    def __init__(self, app: ASGIApp, limit: int, limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.limit = limit
        self.limits = dict(limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope.get("path", ""), self.limit)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    await self._reject(send, limit)
                    return
        received = 0
        started = False
        rejected = False

        async def limited_receive() -> Message:
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Answer 413 now: FastAPI turns any error while reading a body into its own 400.
                    if not started and not rejected:
                        rejected = True
                        await self._reject(send, limit)
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if rejected:
                return  # the 413 is out; drop the app's answer to the aborted read
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started and not rejected:
                await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        body = b'{"error":"payload_too_large","detail":"request body exceeds %d bytes"}' % limit
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def create_app(
    service: str,
    *,
    settings: Settings | None = None,
    ready_checks: dict[str, ReadyCheck] | None = None,
    description: str = "",
    errors: Iterable[int] = (),
    body_limits: dict[str, int] | None = None,
) -> FastAPI:
    """The service's app; ``errors``: statuses every route may answer beyond ``COMMON_ERRORS`` (the
    gateway's 401/403/429 of its key check), documented in the OpenAPI of every route;
    ``body_limits``: paths whose bodies may be larger (or must be smaller) than ``max_body_bytes``."""
    settings = settings or get_settings()
    configure_process(settings)
    app = FastAPI(
        title=f"Loom {service}",
        version=f"{__version__} (schema {SCHEMA_VERSION})",
        description=description,
        responses=error_responses((*COMMON_ERRORS, *errors)),
    )
    app.router.route_class = LoomRoute
    app.state.settings = settings
    app.state.service = service
    app.state.ready_checks = dict(ready_checks or {})
    _add_metrics(app, service)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes, limits=body_limits)
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _crash)
    app.include_router(ops_router)
    return app


def create_queue_app(
    service: str, celery_app: Any, *, ping: tuple[str, ...] | None = None, **kwargs: Any
) -> FastAPI:
    """``create_app`` for a service whose work runs on Celery workers: ``/readyz`` checks
    ``celery_app``'s broker and ``POST /v1/ping`` round-trips the queues of ``ping`` (default: the
    service's own); ``kwargs`` go to ``create_app``."""
    app = create_app(service, ready_checks={"broker": broker_check(celery_app)}, **kwargs)
    add_ping_route(app, celery_app, ping or (service,))
    return app


def internal_error(request: Request, exc: BaseException) -> JSONResponse:
    """503 ``dependency_unavailable`` when a dependency is down, else a 500 with a reference to the log."""
    down = _dependency_down(exc)
    if down is not None:
        log.warning("%s %s: %s (%s)", request.method, request.url.path, down, exc)
        return JSONResponse(
            status_code=503,
            content={"error": "dependency_unavailable", "detail": down},
            headers={"Retry-After": "5"},
        )
    ref = uuid.uuid4().hex[:12]
    log.error("unhandled error %s on %s %s", ref, request.method, request.url.path, exc_info=exc)
    return JSONResponse(status_code=500, content={"error": "internal_error", "detail": f"reference {ref}"})


def _add_metrics(app: FastAPI, service: str) -> None:
    """Count and time every request by route (``/metrics``); answer what escapes a route here."""
    registry = CollectorRegistry()
    requests = Counter(
        "loom_http_requests_total", "HTTP requests", ["service", "route", "status"], registry=registry
    )
    latency = Histogram("loom_http_request_seconds", "HTTP latency", ["service", "route"], registry=registry)
    app.state.metrics_registry = registry

    @app.middleware("http")
    async def _metrics(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        t0 = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception as exc:
            # answered here, not by Starlette's ServerErrorMiddleware: that one sends the 500 and then
            # re-raises, and uvicorn closes the connection, so a client's next request on the same
            # keep-alive connection was reset (or hung)
            response = internal_error(request, exc)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests.labels(service, path, str(response.status_code)).inc()
        latency.labels(service, path).observe(time.perf_counter() - t0)
        return response


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = []
    for e in exc.errors():
        msg = str(e.get("msg", ""))
        if e.get("type") == "json_invalid" and (e.get("ctx") or {}).get("error"):
            msg = f"{msg}: {e['ctx']['error']}"  # what is wrong with the body, not only where
        errors.append({"loc": list(e.get("loc", ())), "msg": msg, "type": e.get("type", "")})
    return JSONResponse(
        status_code=422, content={"error": "validation_error", "detail": jsonable_encoder(errors)}
    )


async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(
        status_code=exc.status_code,
        content=jsonable_encoder(error_body(exc.status_code, exc.detail)),
        headers=getattr(exc, "headers", None),
    )


async def _crash(request: Request, exc: Exception) -> JSONResponse:
    return internal_error(request, exc)  # only what escapes the metrics middleware


class ReadyCheckResult(BaseModel):
    ok: bool
    detail: str


class Readiness(BaseModel):
    status: str = Field(description="ready or not_ready")
    service: str
    checks: dict[str, ReadyCheckResult]


# ---------------------------------------------------------------------------- every service's ops routes
ops_router = APIRouter(tags=["ops"], route_class=LoomRoute)


@ops_router.get("/healthz")
async def healthz(request: Request) -> dict[str, str]:
    return {"status": "ok", "service": request.app.state.service}


@ops_router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "A dependency is not ready"}},
)
async def readyz(request: Request) -> JSONResponse:
    checks: dict[str, dict[str, Any]] = {}
    for name, check in request.app.state.ready_checks.items():
        try:
            if asyncio.iscoroutinefunction(check):
                ok, detail = await check()
            else:
                ok, detail = await asyncio.to_thread(check)
        except Exception as exc:  # a failing check is a not-ready answer, not a 500
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        checks[name] = {"ok": bool(ok), "detail": str(detail)}
    ready = all(c["ok"] for c in checks.values())
    service = request.app.state.service
    return JSONResponse(
        status_code=200 if ready else 503,
        content={"status": "ready" if ready else "not_ready", "service": service, "checks": checks},
    )


@ops_router.get(
    "/metrics",
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus"}},
)
async def metrics(request: Request) -> PlainTextResponse:
    return PlainTextResponse(
        generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST
    )


@ops_router.get("/version", response_model=VersionInfo)
async def version(request: Request) -> VersionInfo:
    return VersionInfo(service=request.app.state.service, version=__version__)


def broker_check(celery_app: Any, ttl: float = 2.0) -> ReadyCheck:
    """Readiness check of the broker, cached for ``ttl`` seconds so probes stay cheap."""
    from loom.queue import check_broker

    cache: dict[str, Any] = {"at": 0.0, "value": (False, "not checked")}

    def check() -> tuple[bool, str]:
        now = time.monotonic()
        if now - cache["at"] > ttl:
            cache["value"] = check_broker(celery_app)
            cache["at"] = now
        return cache["value"]

    return check


PING_MAX_DELAY_S = 10.0


class PingRequest(Contract):
    delay: float = Field(
        default=0.0, ge=0.0, le=PING_MAX_DELAY_S, description="seconds the worker sleeps (a diagnostic)"
    )
    timeout: float = Field(default=30.0, gt=0.0, le=600.0)


class PingResult(BaseModel):
    ok: bool
    queues: dict[str, dict[str, Any]] = Field(description="per queue: ok, seconds, worker or error")


def add_ping_route(app: FastAPI, celery_app: Any, services: tuple[str, ...]) -> None:
    """``POST /v1/ping``: a round trip through the queues of ``services`` (a task each, awaited).

    Used by ``loom up --smoke`` and ``loom status`` to prove that workers consume their queues. It
    occupies a worker (up to ``delay``) and a thread of this process (up to ``timeout``), so it is an
    operator's route: the service token (loom/service_token.py; on the gateway, an admin key).
    """

    def _one(name: str, body: PingRequest) -> dict[str, Any]:
        t0 = time.perf_counter()
        from loom.contracts.tasks import ping
        from loom.queue import send

        result = send(celery_app, ping(name), delay=body.delay)
        try:
            value = result.get(timeout=body.timeout, interval=0.05)
            return {"ok": True, "seconds": round(time.perf_counter() - t0, 4), "worker": value}
        except Exception as exc:
            return {"ok": False, "seconds": round(time.perf_counter() - t0, 4), "error": type(exc).__name__}

    @app.post(
        "/v1/ping",
        tags=["ops"],
        response_model=PingResult,
        dependencies=[internal_route_guard(app)],
        responses={
            **UNAUTHORIZED,
            504: {"model": PingResult, "description": "A queue did not answer in time"},
        },
    )
    async def ping(body: PingRequest) -> JSONResponse:
        results = await asyncio.gather(*(asyncio.to_thread(_one, s, body) for s in services))
        out = dict(zip(services, results, strict=True))
        ok = all(r["ok"] for r in out.values())
        return JSONResponse(status_code=200 if ok else 504, content={"ok": ok, "queues": out})


# ------------------------------------------------------------------------------------ slow clients
#
# uvicorn bounds only the idle time between requests (``timeout_keep_alive``): a client that sends its
# headers or its body a byte at a time holds its connection for as long as it likes. The protocol
# below gives each request a reading deadline (docs/security.md, "Read timeouts"), whichever of
# uvicorn's HTTP implementations it extends: complete headers within ``header_timeout_s`` of the
# request's first byte (of the connection, for its first request), and the body within
# ``body_timeout_s`` plus one second per ``body_min_rate`` bytes received. Time during which the server
# itself is not reading (the app has not consumed what came, or a pipelined request waits) does not
# count. A connection past its deadline is closed; one still sending headers is first answered 408.
# Once a request is read, nothing here bounds it: a long answer or an event stream is the app's.

HTTP_PROTOCOLS = ("auto", "httptools", "h11")


@dataclass(frozen=True)
class ReadLimits:
    header_timeout_s: float
    body_timeout_s: float
    body_min_rate: float  # bytes/s; 0: the body has ``body_timeout_s`` in all

    @classmethod
    def from_settings(cls, settings: Settings) -> ReadLimits:
        return cls(settings.header_timeout_s, settings.body_timeout_s, settings.body_min_rate)


def _timeout_answer(seconds: float) -> bytes:
    body = json.dumps(
        {"error": "request_timeout", "detail": f"request headers not received within {seconds:g} s"}
    ).encode()
    head = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


class _ReadDeadlines:
    """Mixed into uvicorn's ``H11Protocol`` or ``HttpToolsProtocol`` (both keep ``cycle``, ``flow``
    and ``transport``; a request's cycle exists once its headers are read, ``more_body`` is false once
    its body is). One timer per connection, re-armed when it fires early."""

    limits: ReadLimits
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    flow: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._timer: asyncio.TimerHandle | None = None
        self._seen: Any = None  # the cycle whose body is being timed
        self._headers_since: float | None = self.loop.time()  # a request's first byte (here: the connection)
        self._body_since = 0.0
        self._body_bytes = 0
        self._arm(self.limits.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._reading_body():
            self._body_bytes += len(data)
        elif self._headers_since is None and self._between_requests():
            self._headers_since = self.loop.time()  # the next request starts
            self._arm(self.limits.header_timeout_s)
        super().data_received(data)  # type: ignore[misc]
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._follow()  # h11 reads a pipelined request here

    def _between_requests(self) -> bool:
        return self.cycle is None or (self.cycle.response_complete and not self._reading_body())

    def _reading_body(self) -> bool:
        return self._seen is not None and self._seen is self.cycle and bool(self.cycle.more_body)

    def _follow(self) -> None:
        """A new request's headers are read: its body's clock starts."""
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen:
            self._seen = cycle
            self._headers_since = None
            self._body_since, self._body_bytes = self.loop.time(), 0
            if cycle.more_body:
                self._arm(self.limits.body_timeout_s)

    def _arm(self, delay: float) -> None:
        """A check in ``delay`` seconds, unless one comes sooner."""
        when = self.loop.time() + max(delay, 0.0)
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = self.loop.call_at(when, self._deadline)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        now = self.loop.time()
        if self._reading_body():
            if self.flow.read_paused:  # the server is behind, not the client: a fresh window
                self._body_since, self._body_bytes = now, 0
                self._arm(self.limits.body_timeout_s)
                return
            rate = self.limits.body_min_rate
            due = self._body_since + self.limits.body_timeout_s + (self._body_bytes / rate if rate else 0.0)
            if now < due:
                self._arm(due - now)
                return
            log.info("closing %s: request body not received in time", _peer(self.transport))
            self.transport.close()
        elif self._headers_since is not None:
            due = self._headers_since + self.limits.header_timeout_s
            if now < due:
                self._arm(due - now)
                return
            log.info("closing %s: request headers not received in time", _peer(self.transport))
            if self._between_requests():
                self.transport.write(_timeout_answer(self.limits.header_timeout_s))
            self.transport.close()


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"


def http_protocol(limits: ReadLimits, implementation: str = "auto") -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``auto``: httptools when installed, else h11, as uvicorn picks)
    with ``limits``' read deadlines; pass it as ``uvicorn.run(..., http=...)``."""
    if implementation not in HTTP_PROTOCOLS:
        raise ValueError(f"unknown HTTP implementation {implementation!r}; expected one of {HTTP_PROTOCOLS}")
    base: type[asyncio.Protocol]
    if implementation == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        base = H11Protocol
    elif implementation == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        base = HttpToolsProtocol
    else:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(f"Bounded{base.__name__}", (_ReadDeadlines, base), {"limits": limits})


def serve(app: Any, host: str, port: int, settings: Settings | None = None, **uvicorn_args: Any) -> None:
    """Run ``app`` (an ASGI app or its ``"module:attr"``) under uvicorn with Loom's read deadlines
    (``LOOM_HEADER_TIMEOUT_S``, ``LOOM_BODY_TIMEOUT_S``, ``LOOM_BODY_MIN_RATE``) on the HTTP
    implementation ``LOOM_HTTP_PROTOCOL`` names. No Loom route is a WebSocket: none is served."""
    import uvicorn

    settings = settings or get_settings()
    protocol = http_protocol(ReadLimits.from_settings(settings), settings.http_protocol)
    uvicorn.run(app, host=host, port=port, http=protocol, ws="none", **uvicorn_args)
