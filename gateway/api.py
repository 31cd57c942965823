"""HTTP API of the gateway service: validates, calls the core, returns schemas.

Public routes (all need an API key, see gateway/auth.py): ``/v1/jobs`` (scored groups for external
trainers; poll or server-sent events), ``/v1/runs`` (RL runs driven by this process), ``/v1/queues``
and ``/v1/ping`` (admin). The internal services' APIs are not proxied: the gateway reaches them only
through the named tasks of its pipelines.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import auth_middleware
from gateway.datasets import DatasetError, load_dataset
from gateway.keys import KeyRing
from gateway.manager import Manager
from gateway.models import MAX_VERSION, Created, JobRequest, JobView, RunRequest, RunView, ScoredGroup
from gateway.pipeline import CeleryStages, Stages
from gateway.ratelimit import TokenBuckets
from gateway.state import GatewayState
from gateway.validate import submission_problem
from loom.queue import queue_depths
from loom.service import add_ping_route, broker_check, create_app
from loom.settings import SERVICES, Settings, get_settings

PIPELINE_QUEUES = ("rollout", "reward", "reflect", "learner")
TERMINAL = ("succeeded", "failed", "cancelled")


class Backpressure:
    """429 while any pipeline queue holds more than ``limit`` messages (depth cached for ``ttl`` s)."""

    def __init__(self, celery_app: Any, limit: int, ttl: float = 1.0) -> None:
        self.celery_app = celery_app
        self.limit = limit
        self.ttl = ttl
        self._at = -1e9
        self._depth = 0
        self._lock = threading.Lock()

    def depth(self) -> int:
        with self._lock:
            if time.monotonic() - self._at > self.ttl:
                try:
                    depths = queue_depths(self.celery_app)
                    self._depth = max(
                        (v for k, v in depths.items() if v is not None and k.endswith(PIPELINE_QUEUES)),
                        default=0,
                    )
                except Exception:  # broker unreachable: submissions are stored and resumed later
                    self._depth = 0
                self._at = time.monotonic()
            return self._depth

    def check(self) -> None:
        depth = self.depth()
        if depth > self.limit:
            raise HTTPException(
                status_code=429,
                detail={"error": "backpressure", "queue_depth": depth, "limit": self.limit},
                headers={"Retry-After": str(max(1, min(60, depth // max(self.limit, 1))))},
            )


def finite_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A step's numeric metrics, without any NaN or infinity (JSON has no such numbers)."""
    out = {}
    for k, v in row.items():
        try:
            x = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(x):
            out[k] = x
    return out


def _owner(request: Request) -> str:
    return str(getattr(request.state, "key_name", ""))


def build_app(
    settings: Settings | None = None, celery_app: Any = None, stages: Stages | None = None
) -> FastAPI:
    settings = settings or get_settings()
    if celery_app is None:
        from gateway.tasks import celery_app as default_app

        celery_app = default_app
    app = create_app(
        "gateway",
        settings=settings,
        ready_checks={"broker": broker_check(celery_app)},
        description=__doc__ or "",
    )
    add_ping_route(app, celery_app, SERVICES)
    data_dir = Path(settings.data_dir)
    state = GatewayState(data_dir / "gateway.sqlite")
    stop = threading.Event()
    stages = stages or CeleryStages(celery_app, stop=stop)
    manager = Manager(state, stages, data_dir, stop)
    backpressure = Backpressure(celery_app, settings.gateway_max_queue_depth)
    keys = KeyRing.from_spec(settings.api_keys)
    app.middleware("http")(auth_middleware(keys, TokenBuckets(settings.gateway_rate, settings.gateway_burst)))
    app.state.gateway_state = state
    app.state.manager = manager

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.gateway_run_loop:
            manager.resume_all()
        yield
        await asyncio.to_thread(manager.shutdown)

    app.router.lifespan_context = lifespan
    router = APIRouter(prefix="/v1")

    # ------------------------------------------------------------------------------------------ jobs
    @router.post("/jobs", response_model=Created, tags=["jobs"], status_code=201)
    async def submit_job(body: JobRequest, request: Request) -> Any:
        """Submit prompts for rollout + reward (+ adaptive sampling); idempotent by ``job_key``."""
        await asyncio.to_thread(backpressure.check)
        problem = submission_problem(
            body.items(), body, settings, "tasks" if body.tasks is not None else None
        )
        if problem is not None:
            return JSONResponse(status_code=422, content=problem)
        try:
            job_id, created = state.create_job(
                _owner(request), body.job_key, body.model_dump(mode="json"), len(body.items())
            )
        except KeyError as exc:
            raise HTTPException(
                409,
                {"error": "conflict", "detail": f"job_key names job {exc.args[0]} with a different request"},
            ) from None
        if created and settings.gateway_run_loop:
            manager.start_job(job_id)
        return JSONResponse(status_code=201 if created else 200, content={"id": job_id, "created": created})

    def _job_row(job_id: str, request: Request) -> dict[str, Any]:
        row = state.job(job_id)
        if row is None or row["owner"] != _owner(request):
            raise HTTPException(404, {"error": "not_found", "detail": f"no job {job_id}"})
        return row

    @router.get("/jobs/{job_id}", response_model=JobView, tags=["jobs"])
    async def get_job(job_id: str, request: Request) -> JobView:
        row = _job_row(job_id, request)
        groups = [ScoredGroup.model_validate(p) for _, p in state.job_groups(job_id)]
        return JobView(
            id=job_id,
            job_key=row["job_key"],
            status=row["status"],
            n_prompts=row["n_prompts"],
            n_done=len(groups),
            error=row["error"],
            counters=json.loads(row["counters"] or "{}"),
            groups=sorted(groups, key=lambda g: g.index),
        )

    @router.get("/jobs/{job_id}/events", tags=["jobs"])
    async def job_events(job_id: str, request: Request) -> StreamingResponse:
        """Server-sent events: ``group`` (a ScoredGroup; id = sequence number), then ``end``.
        Reconnect with ``Last-Event-ID`` to continue after the last group received."""
        _job_row(job_id, request)
        try:
            after = min(max(int(request.headers.get("last-event-id", "-1")), -1), MAX_VERSION)
        except ValueError:
            after = -1

        async def stream() -> AsyncIterator[bytes]:
            nonlocal after
            while True:
                for seq, payload in state.job_groups(job_id, after):
                    after = seq
                    yield f"event: group\nid: {seq}\ndata: {json.dumps(payload)}\n\n".encode()
                row = state.job(job_id) or {}
                if row.get("status") in TERMINAL and not state.job_groups(job_id, after):
                    end = {"status": row.get("status"), "error": row.get("error")}
                    yield f"event: end\ndata: {json.dumps(end)}\n\n".encode()
                    return
                if await request.is_disconnected():
                    return
                await asyncio.sleep(0.2)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # ------------------------------------------------------------------------------------------ runs
    @router.post("/runs", response_model=Created, tags=["runs"], status_code=201)
    async def submit_run(body: RunRequest, request: Request) -> Any:
        """Start an RL run; idempotent by ``run_key`` when given."""
        await asyncio.to_thread(backpressure.check)
        try:
            items = await asyncio.to_thread(load_dataset, body.dataset, body.mode)
        except DatasetError as exc:
            raise HTTPException(422, {"error": "invalid_dataset", "detail": str(exc)}) from None
        problem = await asyncio.to_thread(submission_problem, items, body, settings, None)
        if problem is not None:
            return JSONResponse(status_code=422, content=problem)
        try:
            run_id, created = state.create_run(
                _owner(request),
                body.run_key,
                body.model_dump(mode="json"),
                body.schedule.steps,
                body.initial_policy_version,
                body.schedule.batch_size,
            )
        except KeyError as exc:
            raise HTTPException(
                409,
                {"error": "conflict", "detail": f"run_key names run {exc.args[0]} with a different request"},
            ) from None
        if created and settings.gateway_run_loop:
            manager.start_run(run_id)
        return JSONResponse(status_code=201 if created else 200, content={"id": run_id, "created": created})

    def _run_row(run_id: str, request: Request) -> dict[str, Any]:
        row = state.run(run_id)
        if row is None or row["owner"] != _owner(request):
            raise HTTPException(404, {"error": "not_found", "detail": f"no run {run_id}"})
        return row

    @router.get("/runs/{run_id}", response_model=RunView, tags=["runs"])
    async def get_run(run_id: str, request: Request) -> RunView:
        row = _run_row(run_id, request)
        last = state.run_steps(run_id, int(row["completed_steps"]) - 2)
        return RunView(
            id=run_id,
            status=row["status"],
            completed_steps=row["completed_steps"],
            total_steps=row["total_steps"],
            policy_version=row["policy_version"],
            batch_size=row["batch_size"],
            error=row["error"],
            last_metrics=finite_metrics(last[-1] if last else {}),
        )

    @router.get("/runs/{run_id}/metrics", tags=["runs"])
    async def run_metrics(
        run_id: str, request: Request, after: int = Query(-1, ge=-1, le=MAX_VERSION)
    ) -> list[dict[str, Any]]:
        """Per-step metrics (also appended to ``<data_dir>/runs/<id>/metrics.jsonl``)."""
        _run_row(run_id, request)
        return state.run_steps(run_id, after)

    @router.post("/runs/{run_id}/cancel", response_model=RunView, tags=["runs"])
    async def cancel_run(run_id: str, request: Request) -> RunView:
        row = _run_row(run_id, request)
        if row["status"] not in TERMINAL:
            state.set_run(run_id, status="cancelled")
        return await get_run(run_id, request)

    # ------------------------------------------------------------------------------------------ ops
    @router.get("/queues", tags=["ops"])
    async def queues() -> dict[str, int | None]:
        """Messages waiting in every queue (admin)."""
        return await asyncio.to_thread(queue_depths, celery_app)

    app.include_router(router)
    return app


app = build_app()
