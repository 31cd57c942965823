"""``/v1/runs``: RL runs driven by this gateway process; start, poll, read metrics, cancel."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Query, Request

from gateway.cost import run_budget
from gateway.datasets import DatasetError, load_dataset, open_owned, owner_admit, store_jsonl
from gateway.models import MAX_VERSION, Created, RunRequest, RunView, TaskItem, lineage_of
from gateway.quotas import Cost, QuotaExceeded, run_cost, too_long
from gateway.routes.datasets import invalid_dataset
from gateway.routes.deps import (
    EXISTING,
    NOT_FOUND,
    Gateway,
    GatewayDep,
    cancel,
    owned,
    owner,
    refused,
    submit,
    view,
)
from loom.contracts.modes import ModeLimits
from loom.contracts.wire import Params
from loom.service import LoomRoute, error_responses

router = APIRouter(prefix="/runs", tags=["runs"], route_class=LoomRoute)


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


async def run_items(gw: Gateway, body: RunRequest, key: str) -> tuple[RunRequest, Sequence[TaskItem]]:
    """The run's items to check before it is stored, and the run with an inline ``dataset.jsonl``
    replaced by the id of the dataset it was stored as (for ``key``, within its dataset quota). A
    dataset ``id`` must be one ``key`` stores. Raises DatasetError or QuotaExceeded."""
    spec = body.dataset
    if spec.builtin is not None:
        return body, await asyncio.to_thread(load_dataset, spec, body.mode)
    if spec.jsonl is not None:
        admit = owner_admit(gw.state, key, gw.quotas)
        dataset_id, _ = await asyncio.to_thread(store_jsonl, spec.jsonl, gw.datasets, admit)
        spec = spec.model_copy(update={"jsonl": None, "id": dataset_id})
        body = body.model_copy(update={"dataset": spec})
    stored = await asyncio.to_thread(open_owned, gw.state, gw.datasets, key, spec.id or "", spec.task)
    # uploaded rows carry no mode parameters of their own: the first stands for them all
    return body, [stored[0]]


@router.post("", response_model=Created, status_code=201, responses={**EXISTING, **error_responses((409,))})
async def submit_run(body: RunRequest, request: Request, gw: GatewayDep) -> Any:
    """Start an RL run; idempotent by ``run_key`` when given. Inline ``dataset.jsonl`` is stored as
    a dataset first (the run's config keeps its id). Over a quota of the key: 422 or 429 (413: the
    inline JSONL past its dataset quota)."""
    await asyncio.to_thread(gw.backpressure.check)
    _, at_least = run_cost(body)  # by n alone, a lower bound: refused before a dataset is stored
    long = too_long(at_least, gw.quotas)
    if long is not None:
        return refused(long)
    try:
        body, items = await run_items(gw, body, owner(request))
    except DatasetError as exc:
        raise invalid_dataset(exc) from None
    except QuotaExceeded as exc:  # inline JSONL past the key's dataset quota
        return refused(exc)
    limits = ModeLimits.from_settings(gw.settings)

    def charge(checked: RunRequest, resolved: Sequence[Params]) -> Cost:
        cost, total = run_budget(checked, resolved, limits)
        refusal = too_long(total, gw.quotas)
        if refusal is not None:
            raise refusal
        return cost

    runs = gw.state.runs
    return await submit(gw, request, runs, body, items=items, cost=charge, start=gw.manager.start_run)


@router.get("/{run_id}", response_model=RunView, responses=NOT_FOUND)
async def get_run(run_id: str, request: Request, gw: GatewayDep) -> RunView:
    """The run, its lineage (its own namespace, its base) and the versions it has published."""
    row = owned(gw.state.runs.get(run_id), request, "run", run_id)
    steps = await asyncio.to_thread(gw.state.runs.steps, run_id)
    lineage = lineage_of(run_id, RunRequest.model_validate(row.config))
    # the versions its steps published (a skipped update publishes none), in its own namespace
    versions = sorted({int(m["policy_version"]) for m in steps} - {lineage.base_version})
    last = steps[-1:]
    metrics = finite_metrics(last[-1] if last else {})
    return view(RunView, row, last_metrics=metrics, lineage=lineage, versions=versions)


@router.get("/{run_id}/samples", responses=NOT_FOUND)
async def run_samples(
    run_id: str,
    request: Request,
    gw: GatewayDep,
    step: int | None = Query(None, ge=0, le=MAX_VERSION),
    after: int = Query(-1, ge=-1, le=MAX_VERSION),
) -> list[dict[str, Any]]:
    """The scored groups the run stored (a few per step, as the run page shows them): one step's
    (``step``) or every step's after ``after``; each ``{step, idx, group_id, group, rewards}``."""
    owned(gw.state.runs.get(run_id), request, "run", run_id)
    return await asyncio.to_thread(gw.state.runs.samples, run_id, step, after)


@router.get("/{run_id}/metrics", responses=NOT_FOUND)
async def run_metrics(
    run_id: str, request: Request, gw: GatewayDep, after: int = Query(-1, ge=-1, le=MAX_VERSION)
) -> list[dict[str, Any]]:
    """Per-step metrics (also appended to ``<data_dir>/runs/<id>/metrics.jsonl``)."""
    owned(gw.state.runs.get(run_id), request, "run", run_id)
    return gw.state.runs.steps(run_id, after)


@router.post("/{run_id}/cancel", response_model=RunView, responses=NOT_FOUND)
async def cancel_run(run_id: str, request: Request, gw: GatewayDep) -> RunView:
    """Cancel a queued or running run: nothing is trained or recorded after this answer, and its
    tasks still queued are skipped by key."""
    owned(gw.state.runs.get(run_id), request, "run", run_id)
    await cancel(gw, gw.state.runs, run_id)
    return await get_run(run_id, request, gw)
