"""HTTP API of the rollout service: validates, calls the core, returns schemas."""

from __future__ import annotations

from loom.service import add_ping_route, broker_check, create_app
from rollout_svc.tasks import celery_app

app = create_app(
    "rollout",
    ready_checks={"broker": broker_check(celery_app)},
    description="Generation: engines (vLLM server, torch) and rollout modes.",
)
add_ping_route(app, celery_app, ("rollout",))
