"""HTTP API of the learner service: validates, calls the core (through the learner worker, which owns
the policy), returns schemas.

- ``POST /v1/train_step``: a TrainBatch -> StepResult (one optimizer step; the new PolicyVersion).
  The batch is checked here first (every trajectory has a reward, the tree/threads an estimator
  needs), so a bad batch is a 422, never a failed task.
- ``POST /v1/score/attention``: FCI scores of a response's steps under the current policy.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from celery.exceptions import TimeoutError as CeleryTimeout
from fastapi import FastAPI, HTTPException, Query
from pydantic import Field, model_validator

from learner.assign import assign_batch
from loom.schemas import MAX_ATTENTION_STEPS, Contract, StepResult, TrainBatch
from loom.service import add_ping_route, broker_check, create_app
from loom.settings import Settings


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
    timeout: float = Field(default=120.0, gt=0.0, le=3600.0)

    @model_validator(mode="after")
    def _spans(self) -> AttentionRequest:
        for i, (a, b) in enumerate(self.steps):
            if not 0 <= a < b <= len(self.token_ids):
                raise ValueError(f"steps[{i}] = [{a}, {b}) is empty or outside the sequence")
        return self


class AttentionScores(Contract):
    scores: list[float]
    policy_version: int


def _run(celery_app: Any, name: str, kwargs: dict[str, Any], timeout: float) -> Any:
    result = celery_app.send_task(name, kwargs=kwargs)
    try:
        return result.get(timeout=timeout, interval=0.05)
    except ValueError as exc:
        raise HTTPException(422, {"error": "invalid_batch", "detail": str(exc)}) from exc
    except (TimeoutError, CeleryTimeout) as exc:  # Celery's is not the built-in one
        detail = f"{name} took longer than {timeout} s"
        raise HTTPException(504, {"error": "timeout", "detail": detail}) from exc


def build_app(settings: Settings | None = None, celery_app: Any = None) -> FastAPI:
    """The learner API over ``celery_app`` (default: the learner's own app from the settings)."""
    if celery_app is None:
        from learner.tasks import celery_app as default_app

        celery_app = default_app
    app = create_app(
        "learner",
        settings=settings,
        ready_checks={"broker": broker_check(celery_app)},
        description="Advantages, losses, train steps and policy versions.",
        errors=(504,),  # a step or a score that took longer than its timeout
    )
    add_ping_route(app, celery_app, ("learner",))

    @app.post("/v1/train_step", response_model=StepResult, tags=["learner"])
    async def train_step(batch: TrainBatch, timeout: float = Query(1800.0, gt=0.0, le=86400.0)) -> StepResult:
        try:  # pure: rejects a batch the worker could not train on (off the event loop: trees can be big)
            await asyncio.to_thread(assign_batch, batch)
        except (ValueError, TypeError, AttributeError) as exc:  # TypeError: e.g. estimator_params.eps=[1]
            raise HTTPException(
                422, {"error": "invalid_batch", "detail": f"{type(exc).__name__}: {exc}"}
            ) from exc
        kwargs = {"batch": batch.model_dump(mode="json")}
        body = await asyncio.to_thread(_run, celery_app, "learner.train_step", kwargs, timeout)
        return StepResult.model_validate(body)

    @app.post("/v1/score/attention", response_model=AttentionScores, tags=["learner"])
    async def score_attention(body: AttentionRequest) -> AttentionScores:
        kwargs = body.model_dump(mode="json", exclude={"timeout"})
        out = await asyncio.to_thread(_run, celery_app, "learner.score_attention", kwargs, body.timeout)
        return AttentionScores.model_validate(out)

    return app


app = build_app()
