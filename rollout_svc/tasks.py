"""Celery tasks of the rollout service (queue ``rollout``): thin shells over the core modules."""

from __future__ import annotations

from loom.queue import make_celery

celery_app = make_celery("rollout")
