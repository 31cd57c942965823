"""HTTP API of the gateway service: validates, calls the core, returns schemas."""

from __future__ import annotations

from gateway.tasks import celery_app
from loom.service import add_ping_route, broker_check, create_app
from loom.settings import SERVICES

app = create_app(
    "gateway",
    ready_checks={"broker": broker_check(celery_app)},
    description="Public API: auth, jobs and RL runs; drives pipelines over the queues.",
)
add_ping_route(app, celery_app, SERVICES)
