"""HTTP API of the sandbox service: validates, runs in this process's warm pool, returns outcomes.

``POST /v1/sandbox/run`` and ``/v1/sandbox/batch`` are Loom's shape (``loom.contracts.sandbox``);
``POST /run_code`` is SandboxFusion's (``sandbox_svc.fusion``); ``/v1/sessions`` are interpreter
sessions, the sandbox as a tool (``sandbox_svc.session``). A full pool or a full set of sessions is a
429 ``busy`` with Retry-After, never an unbounded wait; ``/readyz`` fails while bubblewrap is missing.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from loom.contracts.sandbox import (
    BatchRequest,
    BatchResult,
    CallResult,
    RunRequest,
    RunResult,
    SessionCall,
    SessionInfo,
    SessionOpen,
)
from loom.runtime import Shared
from loom.service import create_queue_app
from sandbox_svc.config import get_sandbox_settings
from sandbox_svc.fusion import RunCodeRequest, RunCodeResponse, from_result, to_run
from sandbox_svc.pool import Busy, SandboxPool
from sandbox_svc.runner import bwrap_path
from sandbox_svc.session import SessionBusy, SessionManager, UnknownSession
from sandbox_svc.tasks import celery_app

app = create_queue_app(
    "sandbox",
    celery_app,
    description="Sandbox: model-written Python and bash in bubblewrap with limits; typed outcomes.",
    errors=(404, 409, 429),
)
app.state.ready_checks["bubblewrap"] = lambda: (
    (True, "installed")
    if bwrap_path(get_sandbox_settings().bwrap)
    else (False, "bubblewrap is not installed (deploy/setup.sh)")
)

_pool: Shared[SandboxPool] = Shared(lambda: SandboxPool.from_settings(get_sandbox_settings()))
get_pool = _pool.get  # the process's pool, started on first use
_close_pool = _pool.close
app.router.on_shutdown.append(_close_pool)
_sessions: Shared[SessionManager] = Shared(lambda: SessionManager.from_settings(get_sandbox_settings()))
get_sessions = _sessions.get  # the process's interpreter sessions, started on first use
_close_sessions = _sessions.close
app.router.on_shutdown.append(_close_sessions)


@app.exception_handler(Busy)
async def _busy(request: Request, exc: Busy) -> JSONResponse:
    return JSONResponse(
        status_code=429,
        content={"error": "busy", "detail": f"the sandbox is full ({exc}); retry later"},
        headers={"Retry-After": str(max(1, round(exc.retry_after_s)))},
    )


@app.exception_handler(UnknownSession)
async def _unknown(request: Request, exc: UnknownSession) -> JSONResponse:
    detail = f"no session {exc.args[0]!r} in this sandbox process (never opened, or forgotten)"
    return JSONResponse(status_code=404, content={"error": "unknown_session", "detail": detail})


@app.exception_handler(SessionBusy)
async def _session_busy(request: Request, exc: SessionBusy) -> JSONResponse:
    detail = f"session {exc.args[0]!r} is running a call: calls of one session run one at a time"
    return JSONResponse(status_code=409, content={"error": "session_busy", "detail": detail})


@app.post("/v1/sandbox/run", tags=["sandbox"], response_model=RunResult)
async def run_one(body: RunRequest) -> RunResult:
    """One program: its typed outcome, stdout and stderr (bounded), exit status."""
    return (await get_pool().arun_batch([body]))[0]


@app.post("/v1/sandbox/batch", tags=["sandbox"], response_model=BatchResult)
async def run_batch(body: BatchRequest) -> BatchResult:
    """Independent runs, each in its own sandbox with its own outcome; admitted whole or 429."""
    return BatchResult(results=await get_pool().arun_batch(body.runs))


@app.post("/run_code", tags=["protocols"], response_model=RunCodeResponse)
async def run_code(body: RunCodeRequest) -> RunCodeResponse:
    """SandboxFusion's ``run_code``: verl's ``sandbox_fusion_url`` may point here."""
    run = to_run(body, RunRequest(code="").limits)
    if isinstance(run, RunCodeResponse):
        return run
    return from_result((await get_pool().arun_batch([run]))[0])


@app.get("/v1/sandbox/health", tags=["sandbox"])
async def health() -> dict[str, Any]:
    """The pool: slots, busy slots, runs in flight, refusals, replaced slots, outcomes by status."""
    return get_pool().health()


@app.post("/v1/sessions", tags=["sessions"], response_model=SessionInfo)
async def open_session(body: SessionOpen | None = None) -> SessionInfo:
    """A Python interpreter that keeps its variables across calls (limits per call and per session);
    ``alive`` false with ``ended: sandbox_error`` when the sandbox could not start it."""
    return await run_in_threadpool(get_sessions().open, body or SessionOpen())


@app.post("/v1/sessions/{session_id}/run", tags=["sessions"], response_model=CallResult)
async def run_in_session(session_id: str, body: SessionCall) -> CallResult:
    """One cell: its typed outcome, stdout and stderr (bounded), and the session after it."""
    return await run_in_threadpool(get_sessions().call, session_id, body.code)


@app.get("/v1/sessions/{session_id}", tags=["sessions"], response_model=SessionInfo)
async def session_info(session_id: str) -> SessionInfo:
    return get_sessions().get(session_id).info()


@app.delete("/v1/sessions/{session_id}", tags=["sessions"], response_model=SessionInfo)
async def close_session(session_id: str) -> SessionInfo:
    """End the session (``closed``) and free its sandbox."""
    return await run_in_threadpool(get_sessions().end, session_id)


@app.get("/v1/sessions", tags=["sessions"])
async def sessions_health() -> dict[str, Any]:
    """Live sessions, the maximum, calls running, opened, refused, ended by reason."""
    return get_sessions().health()
