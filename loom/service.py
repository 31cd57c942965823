"""What every service's FastAPI app has in common.

``create_app(service)`` gives: ``/healthz`` (process alive), ``/readyz`` (broker and the service's own
dependencies), ``/metrics`` (Prometheus text), ``/version``; request-body size limit (413); validation
errors as 422 with the field path; any unhandled error as a typed 500 body without a stack trace.
Services add their routes to the returned app and stay thin.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loom import __version__
from loom.runtime import configure_process
from loom.schemas import SCHEMA_VERSION, Contract, VersionInfo
from loom.settings import Settings, get_settings

log = logging.getLogger("loom.service")

# A readiness check returns (ok, detail). It may be sync or async.
ReadyCheck = Callable[[], "tuple[bool, str] | Awaitable[tuple[bool, str]]"]


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Refuse bodies over ``limit`` bytes with 413, by Content-Length or while streaming."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limit:
                    await self._reject(send)
                    return
        received = 0
        started = False
        rejected = False

        async def limited_receive() -> Message:
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # Answer 413 now: FastAPI turns any error while reading a body into its own 400.
                    if not started and not rejected:
                        rejected = True
                        await self._reject(send)
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
                await self._reject(send)

    async def _reject(self, send: Send) -> None:
        body = b'{"error":"payload_too_large","detail":"request body exceeds %d bytes"}' % self.limit
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
) -> FastAPI:
    settings = settings or get_settings()
    configure_process(settings)
    app = FastAPI(
        title=f"Loom {service}",
        version=f"{__version__} (schema {SCHEMA_VERSION})",
        description=description,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.ready_checks = dict(ready_checks or {})

    registry = CollectorRegistry()
    requests = Counter(
        "loom_http_requests_total", "HTTP requests", ["service", "route", "status"], registry=registry
    )
    latency = Histogram("loom_http_request_seconds", "HTTP latency", ["service", "route"], registry=registry)
    app.state.metrics_registry = registry

    def _internal_error(request: Request, exc: BaseException) -> JSONResponse:
        ref = uuid.uuid4().hex[:12]
        log.error("unhandled error %s on %s %s", ref, request.method, request.url.path, exc_info=exc)
        return JSONResponse(
            status_code=500, content={"error": "internal_error", "detail": f"reference {ref}"}
        )

    @app.middleware("http")
    async def _metrics(request: Request, call_next: Callable[[Request], Awaitable[Any]]) -> Any:
        t0 = time.perf_counter()
        try:
            response = await call_next(request)
        except Exception as exc:
            # answered here, not by Starlette's ServerErrorMiddleware: that one sends the 500 and then
            # re-raises, and uvicorn closes the connection, so a client's next request on the same
            # keep-alive connection was reset (or hung)
            response = _internal_error(request, exc)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests.labels(service, path, str(response.status_code)).inc()
        latency.labels(service, path).observe(time.perf_counter() - t0)
        return response

    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        return JSONResponse(
            status_code=422, content={"error": "validation_error", "detail": jsonable_encoder(errors)}
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail
        error = detail.get("error", "http_error") if isinstance(detail, dict) else "http_error"
        return JSONResponse(
            status_code=exc.status_code,
            content={"error": error, "detail": detail},
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        return _internal_error(request, exc)  # only what escapes the middleware above

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "service": service}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> JSONResponse:
        checks: dict[str, dict[str, Any]] = {}
        for name, check in app.state.ready_checks.items():
            try:
                if asyncio.iscoroutinefunction(check):
                    ok, detail = await check()
                else:
                    ok, detail = await asyncio.to_thread(check)  # type: ignore[arg-type]
            except Exception as exc:  # a failing check is a not-ready answer, not a 500
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            checks[name] = {"ok": bool(ok), "detail": detail}
        ready = all(c["ok"] for c in checks.values())
        return JSONResponse(
            status_code=200 if ready else 503,
            content={"status": "ready" if ready else "not_ready", "service": service, "checks": checks},
        )

    @app.get("/metrics", tags=["ops"])
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", tags=["ops"], response_model=VersionInfo)
    async def version() -> VersionInfo:
        return VersionInfo(service=service, version=__version__)

    return app


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


class PingRequest(Contract):
    delay: float = Field(default=0.0, ge=0.0, le=60.0, description="seconds the worker sleeps")
    timeout: float = Field(default=30.0, gt=0.0, le=600.0)


def add_ping_route(app: FastAPI, celery_app: Any, services: tuple[str, ...]) -> None:
    """``POST /v1/ping``: a round trip through the queues of ``services`` (a task each, awaited).

    Used by ``loom up --smoke`` and ``loom status`` to prove that workers consume their queues.
    """

    def _one(name: str, body: PingRequest) -> dict[str, Any]:
        t0 = time.perf_counter()
        result = celery_app.send_task(f"{name}.ping", kwargs={"delay": body.delay})
        try:
            value = result.get(timeout=body.timeout, interval=0.05)
            return {"ok": True, "seconds": round(time.perf_counter() - t0, 4), "worker": value}
        except Exception as exc:
            return {"ok": False, "seconds": round(time.perf_counter() - t0, 4), "error": type(exc).__name__}

    @app.post("/v1/ping", tags=["ops"])
    async def ping(body: PingRequest) -> JSONResponse:
        results = await asyncio.gather(*(asyncio.to_thread(_one, s, body) for s in services))
        out = dict(zip(services, results, strict=True))
        ok = all(r["ok"] for r in out.values())
        return JSONResponse(status_code=200 if ok else 504, content={"ok": ok, "queues": out})
