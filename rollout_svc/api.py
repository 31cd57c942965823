"""HTTP API of the rollout service: validates, calls the core, returns schemas.

``POST /v1/rollouts`` runs one RolloutRequest on this process's engine and returns the Group (meant
for small synchronous requests; bulk work goes through the ``rollout.generate_group`` task).
``POST /v1/policy`` (internal: needs ``LOOM_SERVICE_TOKEN`` when it is set) loads a version of the
policy store into this process's engine: 0 is the base model; a ``path`` must be one of the store's
version directories; nothing outside the store is ever opened, and a failed load says which version
failed, never why (the reason is in this service's log) (docs/security-workers.md).
``/engine/...``: the same engine behind vLLM's OpenAI surface (rollout_svc/engines/openai_api.py):
``/engine/v1/completions``, ``/engine/v1/chat/completions``, TRL's ``/engine/get_world_size`` ... so
TRL's ``VLLMClient(base_url=".../engine")`` or ``openai.OpenAI(base_url=".../engine/v1")`` generate here;
``/engine/reset_prefix_cache`` and ``/engine/server_info`` (state, configuration) need the service
token, as ``/v1/policy`` and ``/v1/ping`` do.
Mode and engine limits are 422 naming the limit (a prompt the model cannot read names its field); a
checkpoint that cannot be loaded is 422; an unreachable engine is 503; a group past
``LOOM_ROLLOUT_GROUP_TIMEOUT_S``, an engine or the attention scorer timing out is 504.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import Field

from loom.contracts.wire import Contract, Group, RolloutRequest
from loom.service import ErrorBody, create_queue_app
from loom.service_token import UNAUTHORIZED, internal_route_guard
from loom.store import PolicyStoreError
from rollout_svc.config import RolloutSettings
from rollout_svc.engines import get_engine_async, get_tokenizer
from rollout_svc.engines.base import (
    Engine,
    EngineError,
    EngineRequestError,
    InvalidPrompt,
    PolicyLoadError,
    UnsupportedCapability,
)
from rollout_svc.engines.openai_api import Served, basic_routes, create_router, generation_defaults
from rollout_svc.engines.torch import resolve_model_path
from rollout_svc.modes import ModeError
from rollout_svc.rollout import PolicyNotFound, PolicyPathRefused, generate_group, stored_policy
from rollout_svc.tasks import celery_app

log = logging.getLogger("loom.rollout.api")

app = create_queue_app(
    "rollout",
    celery_app,
    description="Generation: engines (vLLM server, torch) and rollout modes.",
    errors=(404,),  # POST /v1/policy: no such version
)
app.state.rollout = RolloutSettings()  # this service's own settings (tests swap it like app.state.settings)
internal = internal_route_guard(app)


def _engine_routes() -> APIRouter:
    """This process's engine (the one ``/v1/rollouts`` uses) behind vLLM's routes, under /engine."""
    settings = app.state.settings
    local = not (settings.engine == "vllm" or settings.engine_url)  # the torch engine: its model here
    path = str(resolve_model_path(settings.model)) if local else None

    async def engine() -> Engine:
        return await get_engine_async(settings)

    async def tokenizer() -> Any:
        return await asyncio.to_thread(get_tokenizer, settings)

    served = Served(engine, tokenizer, settings.model, {settings.model}, path, generation_defaults(path))
    router = APIRouter(prefix="/engine", tags=["engine"])
    # what changes the engine's state or shows its configuration needs the service token; generation
    # stays as open as on a vLLM server, for the openai client and TRL's VLLMClient (docs/security.md)
    basic_routes(router, served, guard=[internal])
    router.include_router(create_router(served, guard=[internal]))
    return router


app.include_router(_engine_routes())


class PolicyRequest(Contract):
    version: int | None = Field(
        default=None, ge=0, description="a version in the policy store (0: the base model); None = latest"
    )
    path: str | None = Field(
        default=None,
        max_length=4096,
        description="a version directory of the policy store (<store>/v<N>), the same as version N; "
        "any other path is refused",
    )
    kind: Literal["full", "lora"] = Field(default="full", description="unused: the store records the kind")
    namespace: str | None = Field(
        default=None,
        max_length=64,
        description="a trainer's namespace (docs/interop-rollout.md); None: the learner's",
    )


def _engine_error(exc: Exception) -> JSONResponse:
    if isinstance(exc, ModeError | UnsupportedCapability | EngineRequestError):
        content = {"error": getattr(exc, "kind", "mode_error"), "detail": str(exc)}
        if isinstance(exc, InvalidPrompt):
            content["field"] = exc.field
        return JSONResponse(status_code=422, content=content)
    kind = getattr(exc, "kind", "engine_error")
    status = 504 if kind.endswith("timeout") else 503
    return JSONResponse(status_code=status, content={"error": kind, "detail": f"{type(exc).__name__}: {exc}"})


@app.post("/v1/rollouts", response_model=Group, tags=["rollout"])
async def rollouts(body: RolloutRequest) -> Group | JSONResponse:
    settings = app.state.settings
    try:
        engine = await get_engine_async(settings)
        return await generate_group(
            body.model_copy(update={"mode_params_resolved": False}),  # an edge: it parses what it gets
            engine,
            lambda: get_tokenizer(settings),
            settings,
            group_timeout_s=app.state.rollout.group_timeout_s,
        )
    except (ModeError, EngineError) as exc:
        return _engine_error(exc)
    except OSError as exc:  # model files missing / unreadable
        return JSONResponse(status_code=503, content={"error": "engine_unavailable", "detail": str(exc)})


@app.post(
    "/v1/policy",
    tags=["rollout"],
    dependencies=[internal],
    responses={
        **UNAUTHORIZED,
        404: {"model": ErrorBody, "description": "no such version in the policy store"},
        503: {"model": ErrorBody, "description": "the remote policy store did not answer"},
        422: {"model": ErrorBody, "description": "a path outside the store, or the version did not load"},
    },
)
async def load_policy(body: PolicyRequest) -> JSONResponse:
    settings = app.state.settings
    try:  # off the event loop: with LOOM_POLICY_STORE_URL this may pull a version over HTTP
        policy = await asyncio.to_thread(stored_policy, settings, body.version, body.path, body.namespace)
    except PolicyStoreError as exc:
        log.warning("policy store unavailable: %s", exc)
        detail = f"the policy store did not answer ({type(exc).__name__})"
        return JSONResponse(status_code=503, content={"error": "policy_store_unavailable", "detail": detail})
    except PolicyPathRefused as exc:
        return JSONResponse(status_code=422, content={"error": "path_refused", "detail": str(exc)})
    except PolicyNotFound as exc:
        return JSONResponse(status_code=404, content={"error": "not_found", "detail": str(exc)})
    try:
        engine = await get_engine_async(settings)
        await engine.load_policy(policy)
    except (PolicyLoadError, OSError, ValueError) as exc:  # the reason names files: logged, not answered
        log.warning("policy version %d did not load: %s", policy.version, exc)
        detail = f"policy version {policy.version} could not be loaded (see the rollout service's log)"
        return JSONResponse(status_code=422, content={"error": "load_failed", "detail": detail})
    except EngineError as exc:
        return _engine_error(exc)
    return JSONResponse({"policy_version": engine.policy_version, "engine": engine.name})
