"""``/v1/queues`` (admin): the broker's queue depths. ``/v1/ping`` is loom.service's."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from gateway.routes.deps import GatewayDep
from loom.queue import queue_depths
from loom.service import LoomRoute

router = APIRouter(tags=["ops"], route_class=LoomRoute)


@router.get("/queues")
async def queues(gw: GatewayDep) -> dict[str, int | None]:
    """Messages waiting in every queue (admin); 503 while the broker is unreachable."""
    return await asyncio.to_thread(queue_depths, gw.celery_app)
