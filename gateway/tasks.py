"""Celery tasks of the gateway service (queue ``gateway``): thin shells over the core modules."""

from __future__ import annotations

from loom.queue import make_celery

celery_app = make_celery("gateway")
