"""HTTP API of the reflect service: validates, calls the core, returns schemas."""

from __future__ import annotations

from loom.service import add_ping_route, broker_check, create_app
from reflect_svc.tasks import celery_app

app = create_app(
    "reflect",
    ready_checks={"broker": broker_check(celery_app)},
    description="Reflection truncation of overthinking and revised samples (REA-RL).",
)
add_ping_route(app, celery_app, ("reflect",))
