"""Celery tasks of the reflect service (queue ``reflect``): thin shells over the core modules.

``reflect.revise_group(group, params=None)``: one group in, the same group with its kept revisions
placed after their originals out (``Group`` JSON; per-trajectory details in ``meta["reflect"]``).
Rollout and reward are reached by their tasks (``LOOM_REFLECT_TRANSPORT=queue``, the default) or
their HTTP APIs (``http``).
"""

from __future__ import annotations

from typing import Any

from loom.contracts.wire import Group, ReflectParams
from loom.queue import make_celery

celery_app = make_celery("reflect")


@celery_app.task(name="reflect.revise_group")
def revise_group_task(group: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    from reflect_svc.backends import make_services, policy_tokenizer
    from reflect_svc.config import get_reflect_settings
    from reflect_svc.revise import revise_group

    cfg = get_reflect_settings()
    services = make_services(cfg, celery_app)
    try:
        result = revise_group(
            Group.model_validate(group),
            ReflectParams.model_validate(params or {}),
            services,
            policy_tokenizer(cfg),
        )
    finally:
        services.close()
    return result.group.model_dump(mode="json")
