"""HTTP API of the reflect service: validates, calls the core, returns schemas.

``POST /v1/reflect``: ``ReflectRequest`` (a group and ``ReflectParams``) -> ``ReflectResult`` (the group
with its kept revisions, and what happened to every trajectory). Bad input the schemas let through
(token ids outside the policy's vocabulary, crossed chunk bounds) is a 422 with the field path; a
failed rollout or reward call is a 503 with a typed error; a failed detector is a per-trajectory
status, never an error. Anything else is a bug of this service: the app's typed 500.
"""

from __future__ import annotations

import asyncio

from fastapi.responses import JSONResponse

from loom.contracts.wire import ReflectRequest, ReflectResult
from loom.service import create_queue_app
from reflect_svc.backends import make_services, policy_tokenizer
from reflect_svc.config import get_reflect_settings
from reflect_svc.revise import InputError, ServiceError, revise_group
from reflect_svc.tasks import celery_app

app = create_queue_app(
    "reflect", celery_app, description="Reflection truncation of overthinking and revised samples (REA-RL)."
)


def _revise(body: ReflectRequest) -> ReflectResult:
    cfg = get_reflect_settings()
    services = make_services(cfg, celery_app, app.state.settings)
    try:
        return revise_group(body.group, body.params, services, policy_tokenizer(cfg, app.state.settings))
    finally:
        services.close()


@app.post("/v1/reflect", tags=["reflect"], response_model=ReflectResult)
async def reflect(body: ReflectRequest) -> ReflectResult | JSONResponse:
    try:
        return await asyncio.to_thread(_revise, body)
    except InputError as exc:
        detail = [{"loc": ["body", *exc.loc], "msg": exc.msg, "type": "validation_error"}]
        return JSONResponse(status_code=422, content={"error": "validation_error", "detail": detail})
    except ServiceError as exc:  # the rollout or reward service failed: typed, no stack trace
        return JSONResponse(status_code=503, content={"error": exc.status, "detail": str(exc)})
