"""HTTP API of the reward service: validates, calls the core, returns schemas."""

from __future__ import annotations

from loom.service import add_ping_route, broker_check, create_app
from reward_svc.tasks import celery_app

app = create_app(
    "reward",
    ready_checks={"broker": broker_check(celery_app)},
    description="Rewards: accuracy, format, length, reflection, efficiency; isolated verification.",
)
add_ping_route(app, celery_app, ("reward",))
