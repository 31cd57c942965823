"""HTTP API of the reward service: validates, calls the core, returns schemas.

Scoring is synchronous in this process's own isolated verifier pool (no queue hop on the latency
path): ``uvicorn reward_svc.api:app`` alone serves every route below.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from loom.schemas import Group, RewardRequest, RewardResult, RewardSpec
from loom.service import add_ping_route, broker_check, create_app
from reward_svc.config import get_reward_settings
from reward_svc.core import (
    RequestError,
    check_request,
    check_spec,
    check_timeout,
    finish_group,
    plan_group,
)
from reward_svc.match import MatchRequest, MatchResponse, finish_matches, plan_matches
from reward_svc.pool import VerifierPool
from reward_svc.protocols import (
    OpenRLHFRequest,
    OpenRLHFResponse,
    SlimeRequest,
    openrlhf_groups,
    openrlhf_response,
    slime_group,
    slime_response,
)
from reward_svc.reflection import DensityStats
from reward_svc.registry import PARAMS
from reward_svc.tasks import celery_app

app = create_app(
    "reward",
    ready_checks={"broker": broker_check(celery_app)},
    description="Rewards: accuracy, format, length, reflection, efficiency; isolated verification.",
)
add_ping_route(app, celery_app, ("reward",))

_settings = get_reward_settings()
_state = DensityStats()
_pool_lock = threading.Lock()
_pool: VerifierPool | None = None


def get_pool() -> VerifierPool:
    """The process's verifier pool, started on first use (forks need math-verify imported first)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = VerifierPool.from_settings(_settings)
        return _pool


def _close_pool() -> None:
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
            _pool = None


app.router.on_shutdown.append(_close_pool)


@app.exception_handler(RequestError)
async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())


async def score_groups(groups: list[Group], spec: RewardSpec) -> list[RewardResult]:
    """Every group's math items go to the pool at once; then each group is composed. ``score_s`` is
    the whole call's time (the groups were scored together)."""
    t0 = time.perf_counter()
    plans = [plan_group(g, spec) for g in groups]
    items = [item for p in plans for _, item in p.math]
    verdicts = await get_pool().acheck_many(items, spec.timeout_s) if items else []
    results, k = [], 0
    for p in plans:
        results.append(finish_group(p, verdicts[k : k + len(p.math)], _state))
        k += len(p.math)
    elapsed = time.perf_counter() - t0
    for r in results:
        r.score_s = elapsed
    return results


class RewardResponse(BaseModel):
    results: list[RewardResult]


@app.post("/v1/rewards", tags=["rewards"], response_model=RewardResponse)
async def rewards(body: RewardRequest) -> RewardResponse:
    """Groups + RewardSpec -> one RewardResult per group (every component, total, status)."""
    check_spec(body.spec)
    check_request(body.groups, _settings.max_items, _settings.max_chars)
    return RewardResponse(results=await score_groups(body.groups, body.spec))


@app.post("/v1/rewards/match", tags=["rewards"], response_model=MatchResponse)
async def match(body: MatchRequest) -> MatchResponse:
    """Does each text state the gold answer? (reflect_svc's ``gold`` detector; same verifier pool.)"""
    _check_texts(body.texts, "texts")
    check_timeout(body.timeout_s, ["body", "timeout_s"], _settings.max_timeout_s)
    if body.label is not None and len(body.label) > _settings.max_chars:
        raise RequestError(422, ["body", "label"], f"longer than {_settings.max_chars} characters")
    decided, math = plan_matches(body)
    verdicts = await get_pool().acheck_many([m for _, m in math], body.timeout_s) if math else []
    return finish_matches(decided, math, verdicts)


@app.get("/v1/rewards/components", tags=["rewards"])
async def components() -> dict[str, Any]:
    """The registry: every component name with its parameter schema."""
    return {name: model.model_json_schema() for name, model in PARAMS.items()}


def _check_texts(texts: list[str], field: str) -> None:
    if len(texts) > _settings.max_items:
        raise RequestError(
            413, ["body", field], f"{len(texts)} items exceed the limit of {_settings.max_items}"
        )
    for i, t in enumerate(texts):
        if len(t) > _settings.max_chars:
            raise RequestError(422, ["body", field, i], f"longer than {_settings.max_chars} characters")


@app.post("/get_reward", tags=["protocols"], response_model=OpenRLHFResponse)
async def get_reward(body: OpenRLHFRequest) -> OpenRLHFResponse:
    """OpenRLHF remote reward model protocol (``--reward.remote_url``)."""
    spec = body.spec or RewardSpec()
    check_spec(spec)
    _check_texts(body.query, "query")
    _check_texts(body.prompts or [], "prompts")
    _check_texts([lab or "" for lab in body.labels or []], "labels")
    groups, where = openrlhf_groups(body)
    return openrlhf_response(await score_groups(groups, spec), where)


@app.post("/v1/slime/reward", tags=["protocols"])
async def slime_reward(body: SlimeRequest) -> dict[str, Any]:
    """slime remote reward protocol (``--rm-type remote_rm``); the reward is in ``reward``."""
    spec = body.spec or RewardSpec()
    check_spec(spec)
    for field in ("prompt", "response", "label"):
        if len(getattr(body, field) or "") > _settings.max_chars:
            raise RequestError(422, ["body", field], f"longer than {_settings.max_chars} characters")
    results = await score_groups([slime_group(body)], spec)
    return slime_response(results[0])
