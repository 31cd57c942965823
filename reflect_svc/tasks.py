"""Celery tasks of the reflect service (queue ``reflect``): thin shells over the core modules."""

from __future__ import annotations

from loom.queue import make_celery

celery_app = make_celery("reflect")
