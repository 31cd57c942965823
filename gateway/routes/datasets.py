"""``/v1/datasets``: JSONL uploads for runs, checked and stored as they stream in, owned by the key that
stored them (scope ``runs``) and bounded by its dataset quota (docs/security.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response

from gateway.datasets import DatasetError, DatasetTooLarge, DatasetWriter, owner_admit, remove_files
from gateway.models import DATASET_ID, DatasetInfo
from gateway.quotas import QuotaExceeded, dataset_too_large
from gateway.routes.deps import NOT_FOUND, GatewayDep, owner, refused
from loom.service import LoomRoute, error_responses

# ``POST /v1/datasets``'s body as OpenAPI can say it: the rows of the JSONL, one object a line
JSONL_ROWS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["prompt"],
        "properties": {"prompt": {"type": "string", "minLength": 1, "maxLength": 100_000}, "answer": {}},
    },
}

router = APIRouter(prefix="/datasets", tags=["runs"], route_class=LoomRoute)


def invalid_dataset(exc: DatasetError) -> HTTPException:
    return HTTPException(422, {"error": "invalid_dataset", "detail": str(exc)})


@router.post(
    "",
    response_model=DatasetInfo,
    status_code=201,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/x-ndjson": {"schema": JSONL_ROWS}},
            "description": "JSONL: one {prompt, answer} object a line",
        }
    },
)
async def upload_dataset(request: Request, gw: GatewayDep) -> Any:
    """Store a JSONL dataset for this key's runs (``dataset: {"id": ...}``), read as it streams in: each
    line is checked as it arrives, so a bad line is a 422 naming it, and the gateway holds a chunk at a
    time, never the whole file (up to ``LOOM_GATEWAY_DATASET_MAX_BYTES``). The id is the SHA-256 of
    the content: the same upload gives the same id. Past the key's dataset quota
    (``LOOM_GATEWAY_QUOTA_DATASET_BYTES``, ``LOOM_GATEWAY_QUOTA_DATASETS``): 413 ``quota_exceeded``,
    as soon as the bytes received pass it, and nothing is stored."""
    key = owner(request)
    bytes_held, _ = await asyncio.to_thread(gw.state.datasets.usage, key)
    writer = DatasetWriter(gw.datasets, max_bytes=max(gw.quotas.dataset_bytes - bytes_held, 0))
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(writer.feed, chunk)
        dataset_id, n_items = await asyncio.to_thread(writer.finish, owner_admit(gw.state, key, gw.quotas))
    except DatasetTooLarge as exc:  # max_bytes is what the key's quota leaves
        return refused(dataset_too_large(exc.size, gw.quotas, bytes_held))
    except QuotaExceeded as exc:  # the count, or other uploads of this key that finished meanwhile
        return refused(exc)
    except DatasetError as exc:
        raise invalid_dataset(exc) from None
    finally:
        writer.abort()  # after finish: nothing left to remove
    return DatasetInfo(id=dataset_id, n_items=n_items)


@router.delete("/{dataset_id}", status_code=204, responses={**NOT_FOUND, **error_responses((409,))})
async def delete_dataset(dataset_id: str, request: Request, gw: GatewayDep) -> Response:
    """Stop storing one of this key's datasets (its bytes leave the key's quota); the files go with the
    last key that stored the content. 409 while a queued or running run of the key reads it; 404 for
    an id the key does not store, as for one that never was."""
    if not DATASET_ID.fullmatch(dataset_id):
        raise HTTPException(404, {"error": "not_found", "detail": f"no dataset {dataset_id}"})
    try:
        reader = await asyncio.to_thread(
            gw.state.datasets.drop, owner(request), dataset_id, lambda: remove_files(gw.datasets, dataset_id)
        )
    except KeyError:
        raise HTTPException(404, {"error": "not_found", "detail": f"no dataset {dataset_id}"}) from None
    if reader is not None:
        raise HTTPException(
            409,
            {
                "error": "conflict",
                "detail": f"run {reader} reads dataset {dataset_id}: cancel it or wait for its end",
            },
        )
    return Response(status_code=204)
