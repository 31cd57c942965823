"""HTTP API of the env tier: health and the ping round trip only (``/readyz`` checks the broker).
Episodes go over the queue (``env_svc/tasks.py``, docs/environments.md): their state lives in the
worker that opened them, which an HTTP replica could not reach."""

from __future__ import annotations

from env_svc.tasks import celery_app
from loom.service import create_queue_app

app = create_queue_app(
    "env", celery_app, description="Environments: agent episodes' environments, on their own workers."
)
