"""HTTP API of the gateway service: validates, calls the core, returns schemas.

Public routes (all need an API key, see gateway/auth.py): ``/v1/jobs`` (scored groups for external
trainers; poll or server-sent events; cancel), ``/v1/runs`` (RL runs driven by this process),
``/v1/datasets`` (JSONL uploads for runs, streamed to disk), ``/v1/queues`` and ``/v1/ping`` (admin).
The internal services' APIs are not proxied: the gateway reaches them only through the named tasks of
its pipelines. Per-key quotas, failed-key limits and error bodies: docs/security.md.
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
from starlette.types import Receive, Scope, Send

from gateway.auth import auth_middleware
from gateway.datasets import (
    DatasetError,
    DatasetWriter,
    StoredDataset,
    dataset_root,
    load_dataset,
    store_jsonl,
)
from gateway.keys import KeyRing
from gateway.manager import Manager
from gateway.models import (
    MAX_VERSION,
    Created,
    DatasetInfo,
    JobRequest,
    JobView,
    RunRequest,
    RunView,
    ScoredGroup,
)
from gateway.pipeline import CeleryStages, Stages
from gateway.quotas import QuotaExceeded, Quotas, job_cost, run_cost, too_long
from gateway.ratelimit import TokenBuckets
from gateway.state import GatewayState
from gateway.validate import submission_problem
from loom.queue import queue_depths
from loom.service import LoomRoute, add_ping_route, broker_check, create_app, error_responses
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
                detail={
                    "error": "backpressure",
                    "detail": f"a pipeline queue holds {depth} messages, more than {self.limit}",
                    "queue_depth": depth,
                    "limit": self.limit,
                },
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


def _refused(exc: QuotaExceeded) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body(), headers=exc.headers())


class CountedStream(StreamingResponse):
    """An event stream that gives its slot back however it ends (finished, client gone, error)."""

    def __init__(self, release: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


# ``POST /v1/datasets``'s body as OpenAPI can say it: the rows of the JSONL, one object a line
JSONL_ROWS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string", "minLength": 1, "maxLength": 100_000}, "answer": {}},
    },
}
STREAM_POLL_S = 0.2  # how often an event stream looks for a change of the database
STREAM_FULL_READ_S = 2.0  # and reads its job even without one (a change made on its own connection)


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
        errors=(401, 403, 429),
        body_limits={"/v1/datasets": settings.gateway_dataset_max_bytes},
    )
    add_ping_route(app, celery_app, SERVICES)
    data_dir = Path(settings.data_dir)
    datasets = dataset_root(data_dir)
    state = GatewayState(data_dir / "gateway.sqlite")
    stop = threading.Event()
    stages = stages or CeleryStages(celery_app, stop=stop)
    manager = Manager(state, stages, data_dir, stop)
    backpressure = Backpressure(celery_app, settings.gateway_max_queue_depth)
    quotas = Quotas.from_settings(settings)
    keys = KeyRing.from_spec(settings.api_keys)
    app.middleware("http")(
        auth_middleware(
            keys,
            TokenBuckets(settings.gateway_rate, settings.gateway_burst),
            TokenBuckets(settings.gateway_auth_fail_rate, settings.gateway_auth_fail_burst),
        )
    )
    app.state.gateway_state = state
    app.state.manager = manager
    streams: dict[str, int] = {}  # open event streams per key (this process)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.gateway_run_loop:
            manager.resume_all()
        yield
        await asyncio.to_thread(manager.shutdown)

    app.router.lifespan_context = lifespan
    router = APIRouter(prefix="/v1", route_class=LoomRoute)
    existing: dict[int | str, dict[str, Any]] = {
        200: {"model": Created, "description": "The idempotency key names this existing work"}
    }
    not_found = error_responses((404,))

    # ------------------------------------------------------------------------------------------ jobs
    @router.post(
        "/jobs",
        response_model=Created,
        tags=["jobs"],
        status_code=201,
        responses={**existing, **error_responses((409,))},
    )
    async def submit_job(body: JobRequest, request: Request) -> Any:
        """Submit prompts for rollout + reward (+ adaptive sampling); idempotent by ``job_key``. Over a
        quota of the key: 422 (never fits) or 429 (not beside its other work)."""
        await asyncio.to_thread(backpressure.check)
        items = body.items()
        problem = submission_problem(items, body, settings, "tasks" if body.tasks is not None else None)
        if problem is not None:
            return JSONResponse(status_code=422, content=problem)
        try:
            job_id, created = await asyncio.to_thread(
                state.create_job,
                _owner(request),
                body.job_key,
                body.model_dump(mode="json"),
                len(items),
                job_cost(body, len(items)),
                quotas,
            )
        except QuotaExceeded as exc:
            return _refused(exc)
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

    @router.get("/jobs/{job_id}", response_model=JobView, tags=["jobs"], responses=not_found)
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

    @router.post("/jobs/{job_id}/cancel", response_model=JobView, tags=["jobs"], responses=not_found)
    async def cancel_job(job_id: str, request: Request) -> JobView:
        """Cancel a queued or running job: no group of it is generated or scored after this answer
        (its tasks still queued are skipped by key); groups already stored stay readable. A job that
        has ended is left as it is."""
        _job_row(job_id, request)
        if await asyncio.to_thread(state.finish, "jobs", job_id, "cancelled"):
            await manager.cancel(job_id)
        return await get_job(job_id, request)

    @router.get(
        "/jobs/{job_id}/events",
        tags=["jobs"],
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "SSE"},
            **not_found,
        },
    )
    async def job_events(job_id: str, request: Request) -> StreamingResponse:
        """Server-sent events: ``group`` (a ScoredGroup; id = sequence number), then ``end``.
        Reconnect with ``Last-Event-ID`` to continue after the last group received. A key may hold
        ``LOOM_GATEWAY_QUOTA_STREAMS`` streams open at once (429 beyond)."""
        _job_row(job_id, request)
        try:
            after = min(max(int(request.headers.get("last-event-id", "-1")), -1), MAX_VERSION)
        except ValueError:
            after = -1
        owner = _owner(request)
        if streams.get(owner, 0) >= quotas.streams:
            exc = QuotaExceeded(
                429,
                "streams",
                quotas.streams,
                1,
                streams.get(owner, 0),
                f"this key has {quotas.streams} event streams open, the most it may "
                "(LOOM_GATEWAY_QUOTA_STREAMS); close one, or poll GET /v1/jobs/{id}",
            )
            return _refused(exc)  # type: ignore[return-value]
        streams[owner] = streams.get(owner, 0) + 1

        def release() -> None:
            streams[owner] -= 1
            if not streams[owner]:
                del streams[owner]

        async def stream() -> AsyncIterator[bytes]:
            nonlocal after
            version, last_read = -1, 0.0
            while True:
                # read the job only when the database changed (or every STREAM_FULL_READ_S): an idle
                # stream costs one PRAGMA per poll, not two queries
                now = time.monotonic()
                seen = state.data_version()
                if seen != version or now - last_read >= STREAM_FULL_READ_S:
                    version, last_read = seen, now
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
                await asyncio.sleep(STREAM_POLL_S)

        return CountedStream(
            release, stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    # ------------------------------------------------------------------------------------------ runs
    @router.post(
        "/datasets",
        response_model=DatasetInfo,
        tags=["runs"],
        status_code=201,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/x-ndjson": {"schema": JSONL_ROWS}},
                "description": "JSONL: one {prompt, answer} object a line",
            }
        },
    )
    async def upload_dataset(request: Request) -> DatasetInfo:
        """Store a JSONL dataset for runs (``dataset: {"id": ...}``), read as it streams in: each line is
        checked as it arrives, so a bad line is a 422 naming it, and the gateway holds a chunk at a
        time, never the whole file (up to ``LOOM_GATEWAY_DATASET_MAX_BYTES``). The id is the SHA-256
        of the content: the same upload gives the same id."""
        writer = DatasetWriter(datasets)
        try:
            async for chunk in request.stream():
                if chunk:
                    await asyncio.to_thread(writer.feed, chunk)
            dataset_id, n_items = await asyncio.to_thread(writer.finish)
        except DatasetError as exc:
            raise HTTPException(422, {"error": "invalid_dataset", "detail": str(exc)}) from None
        finally:
            writer.abort()  # after finish: nothing left to remove
        return DatasetInfo(id=dataset_id, n_items=n_items)

    @router.post(
        "/runs",
        response_model=Created,
        tags=["runs"],
        status_code=201,
        responses={**existing, **error_responses((409,))},
    )
    async def submit_run(body: RunRequest, request: Request) -> Any:
        """Start an RL run; idempotent by ``run_key`` when given. Inline ``dataset.jsonl`` is stored as
        a dataset first (the run's config keeps its id). Over a quota of the key: 422 or 429."""
        await asyncio.to_thread(backpressure.check)
        cost, total = run_cost(body)
        long = too_long(total, quotas)
        if long is not None:
            return _refused(long)
        spec = body.dataset
        try:
            if spec.builtin is not None:
                items = await asyncio.to_thread(load_dataset, spec, body.mode)
            else:
                if spec.jsonl is not None:
                    dataset_id, _ = await asyncio.to_thread(store_jsonl, spec.jsonl, datasets)
                    spec = spec.model_copy(update={"jsonl": None, "id": dataset_id})
                    body = body.model_copy(update={"dataset": spec})
                stored = await asyncio.to_thread(StoredDataset, datasets, spec.id or "", spec.task)
                # uploaded rows carry no mode parameters of their own: the first stands for them all
                items = [stored[0]]
        except DatasetError as exc:
            raise HTTPException(422, {"error": "invalid_dataset", "detail": str(exc)}) from None
        problem = await asyncio.to_thread(submission_problem, items, body, settings, None)
        if problem is not None:
            return JSONResponse(status_code=422, content=problem)
        try:
            run_id, created = await asyncio.to_thread(
                state.create_run,
                _owner(request),
                body.run_key,
                body.model_dump(mode="json"),
                body.schedule.steps,
                body.initial_policy_version,
                body.schedule.batch_size,
                cost,
                quotas,
            )
        except QuotaExceeded as exc:
            return _refused(exc)
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

    @router.get("/runs/{run_id}", response_model=RunView, tags=["runs"], responses=not_found)
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

    @router.get("/runs/{run_id}/metrics", tags=["runs"], responses=not_found)
    async def run_metrics(
        run_id: str, request: Request, after: int = Query(-1, ge=-1, le=MAX_VERSION)
    ) -> list[dict[str, Any]]:
        """Per-step metrics (also appended to ``<data_dir>/runs/<id>/metrics.jsonl``)."""
        _run_row(run_id, request)
        return state.run_steps(run_id, after)

    @router.post("/runs/{run_id}/cancel", response_model=RunView, tags=["runs"], responses=not_found)
    async def cancel_run(run_id: str, request: Request) -> RunView:
        """Cancel a queued or running run: nothing is trained or recorded after this answer, and its
        tasks still queued are skipped by key."""
        _run_row(run_id, request)
        if await asyncio.to_thread(state.finish, "runs", run_id, "cancelled"):
            await manager.cancel(run_id)
        return await get_run(run_id, request)

    # ------------------------------------------------------------------------------------------ ops
    @router.get("/queues", tags=["ops"])
    async def queues() -> dict[str, int | None]:
        """Messages waiting in every queue (admin); 503 while the broker is unreachable."""
        return await asyncio.to_thread(queue_depths, celery_app)

    app.include_router(router)
    return app


app = build_app()
