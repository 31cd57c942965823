"""``/v1/datasets``: JSONL uploads for runs, checked and stored as they stream in."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, HTTPException, Request

from gateway.datasets import DatasetError, DatasetWriter
from gateway.models import DatasetInfo
from gateway.routes.deps import GatewayDep
from loom.service import LoomRoute

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
async def upload_dataset(request: Request, gw: GatewayDep) -> DatasetInfo:
    """Store a JSONL dataset for runs (``dataset: {"id": ...}``), read as it streams in: each line is
    checked as it arrives, so a bad line is a 422 naming it, and the gateway holds a chunk at a
    time, never the whole file (up to ``LOOM_GATEWAY_DATASET_MAX_BYTES``). The id is the SHA-256
    of the content: the same upload gives the same id."""
    writer = DatasetWriter(gw.datasets)
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(writer.feed, chunk)
        dataset_id, n_items = await asyncio.to_thread(writer.finish)
    except DatasetError as exc:
        raise invalid_dataset(exc) from None
    finally:
        writer.abort()  # after finish: nothing left to remove
    return DatasetInfo(id=dataset_id, n_items=n_items)
