"""``/v1/jobs``: scored groups for external trainers; submit, poll, follow as server-sent events,
cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.cost import job_budget
from gateway.models import MAX_VERSION, Created, JobRequest, JobView, ScoredGroup
from gateway.quotas import QuotaExceeded
from gateway.routes.deps import (
    EXISTING,
    NOT_FOUND,
    Gateway,
    GatewayDep,
    cancel,
    end_event,
    owned,
    owner,
    refused,
    sse,
    submit,
    view,
)
from gateway.state import GatewayState, JobRow
from loom.contracts.modes import ModeLimits
from loom.service import LoomRoute, error_responses
from loom.timeline import mark

# An event stream checks the database's change counter (one PRAGMA) every STREAM_TICK_S after a
# change, doubling while nothing changes up to STREAM_TICK_MAX_S, and reads its job when it moved. It
# slept 0.2 s between checks before: a group stored waited ~0.1 s on average (up to 0.2 s) for its
# event, 11 % of a 0.9 s TRL call (docs/benchmarks/trl-rollout.md); now <= 16 ms, for ~60
# checks a second of an idle stream (~0.3 % of a core on the 2-core machine). A commit of this
# process (the job driven here: a group stored, the job's end) also ends the wait at once
# (``Database.watch``): the last group and the end no longer wait up to a backed-off tick each.
STREAM_TICK_S = 0.002
STREAM_TICK_MAX_S = 0.016
STREAM_POLL_S = 0.2  # how often an event stream checks that its client is still connected
STREAM_FULL_READ_S = 2.0  # and reads its job even without one (a change made on its own connection)

router = APIRouter(prefix="/jobs", tags=["jobs"], route_class=LoomRoute)


@router.post("", response_model=Created, status_code=201, responses={**EXISTING, **error_responses((409,))})
async def submit_job(body: JobRequest, request: Request, gw: GatewayDep) -> Any:
    """Submit prompts for rollout + reward (+ adaptive sampling); idempotent by ``job_key``. Over a
    quota of the key: 422 (never fits) or 429 (not beside its other work)."""
    await asyncio.to_thread(gw.backpressure.check)
    items = body.items()
    per_item_loc = "tasks" if body.tasks is not None else None
    return await submit(
        gw,
        request,
        gw.state.jobs,
        body,
        items=items,
        per_item_loc=per_item_loc,
        cost=lambda checked, _: job_budget(checked, checked.items(), ModeLimits.from_settings(gw.settings)),
        start=gw.manager.start_job,
    )


PAGE = 64  # groups in a job's view by default: a 4096-prompt job's 6 MB is read a page at a time
MAX_PAGE = 512


def job_view(gw: Gateway, row: JobRow, offset: int = 0, limit: int = PAGE) -> JobView:
    """``row``'s view with one page of its groups (in a thread: reading and parsing a page of a
    large job must not hold the event loop every other request waits on)."""
    n_done, payloads = gw.state.jobs.page(row.id, offset, limit)
    groups = [ScoredGroup.model_validate(p) for p in payloads]
    after = offset + len(groups)
    return view(
        JobView,
        row,
        n_done=n_done,
        groups=groups,
        offset=offset,
        next_offset=after if after < n_done else None,
    )


@router.get("/{job_id}", response_model=JobView, responses=NOT_FOUND)
async def get_job(
    job_id: str,
    request: Request,
    gw: GatewayDep,
    offset: Annotated[int, Query(ge=0, le=2**31, description="the first group of the page")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="groups in the page")] = PAGE,
) -> JobView:
    """The job and one page of its scored groups (``next_offset`` names the next page)."""
    row = owned(await asyncio.to_thread(gw.state.jobs.get, job_id), request, "job", job_id)
    return await asyncio.to_thread(job_view, gw, row, offset, limit)


@router.post("/{job_id}/cancel", response_model=JobView, responses=NOT_FOUND)
async def cancel_job(job_id: str, request: Request, gw: GatewayDep) -> JobView:
    """Cancel a queued or running job: no group of it is generated or scored after this answer
    (its tasks still queued are skipped by key); groups already stored stay readable. A job that
    has ended is left as it is."""
    owned(gw.state.jobs.get(job_id), request, "job", job_id)
    await cancel(gw, gw.state.jobs, job_id)
    row = owned(await asyncio.to_thread(gw.state.jobs.get, job_id), request, "job", job_id)
    return await asyncio.to_thread(job_view, gw, row)


class CountedStream(StreamingResponse):
    """An event stream that gives its slot back however it ends (finished, client gone, error)."""

    def __init__(self, release: Callable[[], None], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def job_event_stream(
    state: GatewayState, job_id: str, after: int, request: Request
) -> AsyncIterator[bytes]:
    """``group`` events after sequence number ``after``, then ``end`` once the job has ended."""
    committed = asyncio.Event()  # set by this process's commits (a job driven here: its groups, its end)
    state.db.watch(committed)
    try:
        async for chunk in _stream(state, job_id, after, request, committed):
            yield chunk
    finally:
        state.db.unwatch(committed)


async def _stream(
    state: GatewayState, job_id: str, after: int, request: Request, committed: asyncio.Event
) -> AsyncIterator[bytes]:
    version, last_read, tick = -1, 0.0, STREAM_TICK_S
    last_check = time.monotonic()
    while True:
        # read the job only when the database changed (or every STREAM_FULL_READ_S): an idle
        # stream costs one PRAGMA per check, not two queries
        committed.clear()  # before the read: a commit after it ends the wait below at once
        now = time.monotonic()
        seen = state.data_version()
        if seen != version or now - last_read >= STREAM_FULL_READ_S:
            version, last_read, tick = seen, now, STREAM_TICK_S
            for seq, payload in state.jobs.groups(job_id, after):
                after = seq
                mark("sent", job_id, seq=seq)
                yield sse("group", payload, seq)
            end = end_event(state.jobs.get(job_id))
            if end is not None and not state.jobs.groups(job_id, after):
                yield end
                return
        else:
            tick = min(tick * 2, STREAM_TICK_MAX_S)
        if now - last_check >= STREAM_POLL_S:
            last_check = now
            if await request.is_disconnected():
                return
        try:
            await asyncio.wait_for(committed.wait(), tick)
        except TimeoutError:
            pass


@router.get(
    "/{job_id}/events",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "SSE"},
        **NOT_FOUND,
    },
)
async def job_events(job_id: str, request: Request, gw: GatewayDep) -> StreamingResponse:
    """Server-sent events: ``group`` (a ScoredGroup; id = sequence number), then ``end``.
    Reconnect with ``Last-Event-ID`` to continue after the last group received. A key may hold
    ``LOOM_GATEWAY_QUOTA_STREAMS`` streams open at once (429 beyond)."""
    owned(gw.state.jobs.get(job_id), request, "job", job_id)
    try:
        after = min(max(int(request.headers.get("last-event-id", "-1")), -1), MAX_VERSION)
    except ValueError:
        after = -1
    key, streams, limit = owner(request), gw.streams, gw.quotas.streams
    if streams.get(key, 0) >= limit:
        exc = QuotaExceeded(
            429,
            "streams",
            limit,
            1,
            streams.get(key, 0),
            f"this key has {limit} event streams open, the most it may "
            "(LOOM_GATEWAY_QUOTA_STREAMS); close one, or poll GET /v1/jobs/{id}",
        )
        return refused(exc)  # type: ignore[return-value]
    streams[key] = streams.get(key, 0) + 1

    def release() -> None:
        streams[key] -= 1
        if not streams[key]:
            del streams[key]

    return CountedStream(
        release,
        job_event_stream(gw.state, job_id, after, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )
