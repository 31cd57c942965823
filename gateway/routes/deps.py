"""What the gateway's routes share: the process's ``Gateway`` (state, manager, admission checks), the
dependency that hands it to a route, and the answers every route group gives the same way."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from gateway.config import GatewaySettings
from gateway.manager import Manager
from gateway.models import Created, TaskItem
from gateway.quotas import Cost, QuotaExceeded, Quotas
from gateway.state import Conflict, GatewayState, JobRow, RunRow, WorkStore
from gateway.validate import check_submission
from loom.contracts.settings import Settings
from loom.contracts.wire import Params
from loom.queue import queue_depths
from loom.service import error_responses

PIPELINE_QUEUES = ("rollout", "reward", "reflect", "learner")
TERMINAL = ("succeeded", "failed", "cancelled")

# the OpenAPI answers of a submission whose idempotency key names existing work, and of a missing item
EXISTING: dict[int | str, dict[str, Any]] = {
    200: {"model": Created, "description": "The idempotency key names this existing work"}
}
NOT_FOUND = error_responses((404,))


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


@dataclass
class Gateway:
    """One gateway process's state, built once by ``gateway.api.build_app`` (``app.state.gateway``)."""

    settings: Settings
    config: GatewaySettings
    celery_app: Any
    state: GatewayState
    manager: Manager
    backpressure: Backpressure
    quotas: Quotas
    datasets: Path  # the stored datasets' folder
    streams: dict[str, int] = field(default_factory=dict)  # open event streams per key (this process)


async def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]


def owner(request: Request) -> str:
    """The name of the API key that made the request (gateway/auth.py)."""
    return str(getattr(request.state, "key_name", ""))


def sse(event: str, data: Any, event_id: int | None = None) -> bytes:
    """One server-sent event (``event_id``: what a reconnect sends back as ``Last-Event-ID``)."""
    head = f"event: {event}\n" if event_id is None else f"event: {event}\nid: {event_id}\n"
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def end_event(row: JobRow | RunRow | None) -> bytes | None:
    """The ``end`` event of a job or run that has ended; None while it has not."""
    if row is None or row.status not in TERMINAL:
        return None
    return sse("end", {"status": row.status, "error": row.error})


def refused(exc: QuotaExceeded) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body(), headers=exc.headers())


Row = TypeVar("Row", JobRow, RunRow)


def owned(row: Row | None, request: Request, kind: str, item_id: str) -> Row:
    """``row`` if it belongs to the request's key; else 404, the same as for an id that never was."""
    if row is None or row.owner != owner(request):
        raise HTTPException(404, {"error": "not_found", "detail": f"no {kind} {item_id}"})
    return row


View = TypeVar("View", bound=BaseModel)


def view(model: type[View], row: JobRow | RunRow, **computed: Any) -> View:
    """The API's ``model`` (``JobView``, ``RunView``) of a stored row: each of its fields the row
    holds, and the ``computed`` ones it does not (a job's groups, a run's last metrics); what only
    the gateway reads (the owner, the stored request, the quota counts) stays out."""
    held = {name: getattr(row, name) for name in model.model_fields if name not in computed}
    return model(**held, **computed)


async def submit(
    gw: Gateway,
    request: Request,
    store: WorkStore[Any],
    body: Any,
    *,
    items: Sequence[TaskItem],
    per_item_loc: str | None = None,
    cost: Cost | Callable[[Any, Sequence[Params]], Cost],
    start: Callable[[str], None],
) -> JSONResponse:
    """Check a submission (its ``items``: 422 naming the first problem, at ``per_item_loc`` for an
    item's own), store it in ``store`` (idempotent by its key) charged ``cost`` (or
    ``cost(checked, resolved)`` of the checked request and its distinct resolved mode parameters:
    the mode budget, which may refuse with QuotaExceeded) and start it:
    201 when new, 200 when the key names the same request, 409 when it names a different one, the
    quota's answer when over."""
    key = owner(request)

    def owns_run(namespace: str) -> bool:  # a run's lineage is its id's namespace
        run = gw.state.runs.get(namespace)
        return run is not None and run.owner == key

    checked = await asyncio.to_thread(check_submission, items, body, gw.settings, per_item_loc, owns_run)
    if checked.problem is not None:
        return JSONResponse(status_code=422, content=checked.problem)
    body = checked.request
    kind = store.kind
    try:
        charge = cost(body, checked.resolved) if callable(cost) else cost
        create_row = partial(store.create, owner=key, request=body, cost=charge, quotas=gw.quotas)
        item_id, created = await asyncio.to_thread(create_row)
    except QuotaExceeded as exc:
        return refused(exc)
    except Conflict as exc:
        raise HTTPException(
            409,
            {
                "error": "conflict",
                "detail": f"{kind}_key names {kind} {exc.item_id} with a different request",
            },
        ) from None
    if created and gw.config.run_loop:
        start(item_id)
    return JSONResponse(status_code=201 if created else 200, content={"id": item_id, "created": created})


async def cancel(gw: Gateway, store: WorkStore[Any], item_id: str) -> None:
    """Mark a job or run cancelled (if it has not ended) and stop its work."""
    if await asyncio.to_thread(store.finish, item_id, "cancelled"):
        await gw.manager.cancel(item_id)
