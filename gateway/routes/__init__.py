"""The gateway's public routes, one module per group; each route validates its request and delegates
to the gateway's state and manager (``deps.Gateway``)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.routes import datasets, jobs, ops, runs
from loom.service import LoomRoute

api_router = APIRouter(prefix="/v1", route_class=LoomRoute)
for _group in (jobs, datasets, runs, ops):  # the order of the OpenAPI document's paths
    api_router.include_router(_group.router)
