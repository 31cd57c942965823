"""Celery tasks of the reflect service (queue ``reflect``): thin shells over the core modules.

The gateway's RL step (gateway/step.py) runs reflection as stages of its own, so these two tasks send
no task: the step generates and scores the revisions, once, with the run's reward spec.

- ``reflect.cut_group(group, params, verdicts=None)``: a ``RevisionPlan``: the gold detector's chunk
  texts to check (without ``verdicts``), else the rollout requests of the group's revisions;
- ``reflect.assemble_group(group, params, plan, completions)``: the group with its draft revisions
  after their originals (texts derived as the rollout service derives them), not yet scored.

``reflect.revise_group(group, params=None)`` is the whole of ``/v1/reflect`` over the queue: it reaches
rollout and reward by their tasks (``LOOM_REFLECT_TRANSPORT=queue``, the default) or their HTTP APIs
(``http``) and scores with ``params.reward``.
"""

from __future__ import annotations

from typing import Any

from loom.contracts.tasks import ASSEMBLE_GROUP, CUT_GROUP, REVISE_GROUP
from loom.contracts.wire import Group, ReflectParams, RevisionPlan
from loom.queue import make_celery, task_of

celery_app = make_celery("reflect")


@task_of(celery_app, CUT_GROUP)
def cut_group_task(
    group: dict[str, Any], params: dict[str, Any], verdicts: list[bool] | None = None
) -> dict[str, Any]:
    from reflect_svc.backends import ModelLabeler, policy_tokenizer, reflection_model
    from reflect_svc.config import get_reflect_settings
    from reflect_svc.revise import plan_revisions

    cfg = get_reflect_settings()
    labeler = ModelLabeler(reflection_model(cfg))
    plan = plan_revisions(
        Group.model_validate(group),
        ReflectParams.model_validate(params),
        policy_tokenizer(cfg),
        verdicts,
        labeler.label,
    )
    return plan.model_dump(mode="json")


@task_of(celery_app, ASSEMBLE_GROUP)
def assemble_group_task(
    group: dict[str, Any], params: dict[str, Any], plan: dict[str, Any], completions: list[dict[str, Any]]
) -> dict[str, Any]:
    from reflect_svc.backends import policy_tokenizer
    from reflect_svc.config import get_reflect_settings
    from reflect_svc.revise import assemble_revisions

    out = assemble_revisions(
        Group.model_validate(group),
        ReflectParams.model_validate(params),
        RevisionPlan.model_validate(plan),
        [Group.model_validate(g) for g in completions],
        policy_tokenizer(get_reflect_settings()),
    )
    return out.model_dump(mode="json")


@task_of(celery_app, REVISE_GROUP)
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
