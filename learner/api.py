"""HTTP API of the learner service: validates, calls the core (through the learner worker, which owns
the policy), returns schemas.

- ``POST /v1/train_step``: a TrainBatch -> StepResult (one optimizer step; the new PolicyVersion).
  The batch is checked here first (every trajectory has a reward, the tree/threads an estimator
  needs), so a bad batch is a 422, never a failed task.
- ``POST /v1/score/attention``: FCI scores of a response's steps under exactly the policy version the
  body names (the rollout's: namespace + version; none: the base model), never whatever lineage the
  learner trained last; one it cannot load is a 409 ``attention_version_unavailable``.
- ``GET /v1/store/...``: the policy store's versions, manifests and files (``loom.store.routes``), so
  rollout replicas on other hosts pull each version without a shared filesystem; a trainer's under
  ``/v1/store/ns/{namespace}/...``, where the gateway also forwards its ``/v1/policies`` uploads
  (docs/interop-rollout.md).

All are internal routes: with ``LOOM_SERVICE_TOKEN`` set they need it (401 otherwise). A wait a
request asks for (``?timeout=``, the body's ``timeout``) above ``LOOM_LEARNER_MAX_WAIT_S`` is a 422;
none asked: that bound (docs/security-workers.md).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Annotated, Any

from celery.exceptions import TimeoutError as CeleryTimeout
from fastapi import FastAPI, HTTPException, Query
from fastapi.exceptions import RequestValidationError
from pydantic import Field, model_validator

from learner.assign import assign_batch
from learner.config import LearnerSettings
from loom.contracts.settings import Settings
from loom.contracts.tasks import SCORE_ATTENTION, TRAIN_STEP, TaskDef
from loom.contracts.wire import MAX_ATTENTION_STEPS, MAX_VERSION, Contract, StepResult, TrainBatch
from loom.queue import send
from loom.service import create_queue_app
from loom.service_token import UNAUTHORIZED, internal_route_guard
from loom.store.routes import add_store_routes
from zoo.registry import resolve_model_path


class AttentionRequest(Contract):
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        min_length=2, max_length=65536, description="prompt + response tokens"
    )
    steps: list[tuple[int, int]] = Field(
        min_length=2,
        max_length=MAX_ATTENTION_STEPS,
        description="[start, end) token spans; steps[0] is the prompt, steps[1] the first step "
        f"(at most {MAX_ATTENTION_STEPS}: the scorer keeps a steps x steps matrix per layer and head)",
    )
    delta: int = Field(default=4, ge=1)
    zero_from: int | None = Field(default=None, ge=0, description="steps from this index on score 0")
    timeout: float = Field(
        default=120.0, gt=0.0, le=3600.0, description="seconds to wait; at most LOOM_LEARNER_MAX_WAIT_S"
    )
    policy_version: int = Field(
        default=0,
        ge=0,
        le=MAX_VERSION,
        description="score under exactly this version (the one the rollout generates with); 0: the "
        "deployment's base model",
    )
    policy_namespace: str | None = Field(
        default=None, max_length=64, description="the namespace of policy_version (None: the learner's)"
    )

    @model_validator(mode="after")
    def _spans(self) -> AttentionRequest:
        for i, (a, b) in enumerate(self.steps):
            if not 0 <= a < b <= len(self.token_ids):
                raise ValueError(f"steps[{i}] = [{a}, {b}) is empty or outside the sequence")
        return self


class AttentionScores(Contract):
    scores: list[float]
    policy_version: int
    policy_namespace: str | None = None


def _run(celery_app: Any, task: TaskDef, kwargs: dict[str, Any], timeout: float) -> Any:
    result = send(celery_app, task, **kwargs)
    try:
        return result.get(timeout=timeout, interval=0.05)
    except ValueError as exc:
        raise HTTPException(422, {"error": "invalid_batch", "detail": str(exc)}) from exc
    except (TimeoutError, CeleryTimeout) as exc:  # Celery's is not the built-in one
        detail = f"{task.name} took longer than {timeout} s"
        raise HTTPException(504, {"error": "timeout", "detail": detail}) from exc


def _bounded_wait(asked: float | None, default: float, bound: float, loc: tuple[str, str]) -> float:
    """The wait to use: ``asked`` (None: ``default``), never above the operator's ``bound``."""
    if asked is not None and asked > bound:
        msg = f"at most {bound} s on this deployment (LOOM_LEARNER_MAX_WAIT_S)"
        raise RequestValidationError([{"loc": loc, "msg": msg, "type": "less_than_equal"}])
    return min(default if asked is None else asked, bound)


def build_app(
    settings: Settings | None = None, celery_app: Any = None, learner: LearnerSettings | None = None
) -> FastAPI:
    """The learner API over ``celery_app`` (default: the learner's own app from the settings);
    ``learner``: its own settings (default ``LOOM_LEARNER_*``), of which the API reads the wait bound."""
    if celery_app is None:
        from learner.tasks import celery_app as default_app

        celery_app = default_app
    app = create_queue_app(
        "learner",
        celery_app,
        settings=settings,
        description="Advantages, losses, train steps and policy versions.",
        errors=(409, 504),  # 409: a score's version not loadable; 504: longer than its timeout
    )
    internal = internal_route_guard(app)
    bound = (learner or LearnerSettings()).max_wait_s
    # the internal routes: the service token, when set (docs/security-workers.md)
    internal_post = functools.partial(
        app.post, tags=["learner"], dependencies=[internal], responses=UNAUTHORIZED
    )

    @internal_post("/v1/train_step", response_model=StepResult)
    async def train_step(
        batch: TrainBatch,
        timeout: float | None = Query(
            None, gt=0.0, description="seconds to wait; default and maximum LOOM_LEARNER_MAX_WAIT_S"
        ),
    ) -> StepResult:
        wait = _bounded_wait(timeout, bound, bound, ("query", "timeout"))
        try:  # pure: rejects a batch the worker could not train on (off the event loop: trees can be big)
            await asyncio.to_thread(assign_batch, batch)
        except (ValueError, TypeError, AttributeError) as exc:  # TypeError: e.g. estimator_params.eps=[1]
            raise HTTPException(
                422, {"error": "invalid_batch", "detail": f"{type(exc).__name__}: {exc}"}
            ) from exc
        kwargs = {"batch": batch.model_dump(mode="json")}
        body = await asyncio.to_thread(_run, celery_app, TRAIN_STEP, kwargs, wait)
        return StepResult.model_validate(body)

    @internal_post("/v1/score/attention", response_model=AttentionScores)
    async def score_attention(body: AttentionRequest) -> AttentionScores:
        asked = body.timeout if "timeout" in body.model_fields_set else None
        wait = _bounded_wait(asked, body.timeout, bound, ("body", "timeout"))
        kwargs = body.model_dump(mode="json", exclude={"timeout"})
        out = await asyncio.to_thread(_run, celery_app, SCORE_ATTENTION, kwargs, wait)
        if out.get("error") == "attention_version_unavailable":  # never another version's scores
            raise HTTPException(409, out)
        return AttentionScores.model_validate(out)

    # the policy store for replicas on other hosts (LOOM_POLICY_STORE_URL); what trainers publish
    # through it is checked against the deployment's base model (loom/store/checks.py)
    add_store_routes(app, internal, resolve_model_path(app.state.settings.model))
    return app


app = build_app()
