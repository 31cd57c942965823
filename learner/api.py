"""HTTP API of the learner service: validates, calls the core, returns schemas."""

from __future__ import annotations

from learner.tasks import celery_app
from loom.service import add_ping_route, broker_check, create_app

app = create_app(
    "learner",
    ready_checks={"broker": broker_check(celery_app)},
    description="Advantages, losses, train steps and policy versions.",
)
add_ping_route(app, celery_app, ("learner",))
