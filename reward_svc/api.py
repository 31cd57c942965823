"""HTTP API of the reward service: validates, calls the core, returns schemas.

Scoring is synchronous in this process's own isolated verifier pool (no queue hop on the latency
path): ``uvicorn reward_svc.api:app`` alone serves every route below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from loom.contracts.reward_settings import get_reward_settings
from loom.contracts.rewards import COMPONENT_PARAMS, RequestError, check_spec, check_timeout
from loom.contracts.wire import Group, RewardRequest, RewardResult, RewardSpec, TaskKind
from loom.runtime import Shared
from loom.service import create_queue_app
from reward_svc.core import (
    Refused,
    check_request,
    finish_group,
    oversized,
    plan_group,
    with_refused,
    without,
)
from reward_svc.match import MatchRequest, MatchResponse, finish_matches, plan_matches
from reward_svc.pool import VerifierPool
from reward_svc.protocols import (
    OpenRLHFRequest,
    OpenRLHFResponse,
    SlimeRequest,
    openrlhf_groups,
    openrlhf_response,
    slime_components,
    slime_group,
)
from reward_svc.reflection import DensityStats
from reward_svc.tasks import celery_app, judge_client, sandbox_client

log = logging.getLogger("reward_svc.api")

app = create_queue_app(
    "reward",
    celery_app,
    description="Rewards: accuracy, format, length, reflection, efficiency; isolated verification.",
)

_settings = get_reward_settings()
_state = DensityStats()
_pool: Shared[VerifierPool] = Shared(lambda: VerifierPool.from_settings(_settings))
get_pool = _pool.get  # the process's verifier pool, started on first use
_close_pool = _pool.close
app.router.on_shutdown.append(_close_pool)


@app.exception_handler(RequestError)
async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
    _log_refusal(request, exc.status, exc.body()["detail"])
    return JSONResponse(status_code=exc.status, content=exc.body())


# OpenRLHF's and slime's clients retry every error (5 and 10 tries) and log only the status code; the
# reason of a refused request is logged here, where the operator can read it.
_PROTOCOL_ROUTES = ("/get_reward", "/v1/slime/")
_shared_validation_handler = app.exception_handlers[RequestValidationError]


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Any:
    _log_refusal(request, 422, exc.errors())
    return await _shared_validation_handler(request, exc)  # type: ignore[misc]


def _log_refusal(request: Request, status: int, detail: Any) -> None:
    if request.url.path.startswith(_PROTOCOL_ROUTES):
        log.warning(
            "%s refused (%d), retrying cannot fix it: %s", request.url.path, status, str(detail)[:500]
        )


async def score_groups(
    groups: list[Group], spec: RewardSpec, refused: list[Refused] | None = None
) -> list[RewardResult]:
    """Every group's math items go to the pool at once; then each group is composed. A trajectory in
    ``refused``, or over ``max_chars``, is not scored: status ``invalid``, reward 0, the rest score.
    ``score_s`` is the whole call's time (the groups were scored together)."""
    t0 = time.perf_counter()
    refused = [
        {**oversized(g, _settings.max_chars), **r}
        for g, r in zip(groups, refused or [{} for _ in groups], strict=True)
    ]
    plans = [plan_group(without(g, r), spec) for g, r in zip(groups, refused, strict=True)]
    items = [item for p in plans for _, item in p.math]
    runs = [run for p in plans for run in p.runs]  # every group's tests in one sandbox batch
    verdicts = await get_pool().acheck_many(items, spec.timeout_s) if items else []
    asks = [ask for p in plans for ask in p.asks]  # and every judge request in one judge batch
    outcomes, replies = await asyncio.gather(
        sandbox_client().arun_batch(runs) if runs else _nothing(),
        judge_client().ask_batch(asks) if asks else _nothing(),
    )
    results, k, j, a = [], 0, 0, 0
    for g, r, p in zip(groups, refused, plans, strict=True):
        n, m = len(p.runs), len(p.asks)
        scored = finish_group(
            p, verdicts[k : k + len(p.math)], _state, outcomes[j : j + n], replies[a : a + m]
        )
        results.append(with_refused(scored, g, r, spec))
        k += len(p.math)
        j += n
        a += m
    elapsed = time.perf_counter() - t0
    for res in results:
        res.score_s = elapsed
    return results


async def _nothing() -> list[Any]:
    return []


class RewardResponse(BaseModel):
    results: list[RewardResult]


@app.post("/v1/rewards", tags=["rewards"], response_model=RewardResponse)
async def rewards(body: RewardRequest) -> RewardResponse:
    """Groups + RewardSpec -> one RewardResult per group (every component, total, status). A text over
    ``max_chars`` is that trajectory's ``invalid`` status (a prompt or label: its group's)."""
    check_spec(body.spec)
    check_request(body.groups, _settings.max_items)
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
    return {name: model.model_json_schema() for name, model in COMPONENT_PARAMS.items()}


def _check_texts(texts: list[str], field: str) -> None:
    if len(texts) > _settings.max_items:
        raise RequestError(
            413, ["body", field], f"{len(texts)} items exceed the limit of {_settings.max_items}"
        )
    for i, t in enumerate(texts):
        if len(t) > _settings.max_chars:
            raise RequestError(422, ["body", field, i], f"longer than {_settings.max_chars} characters")


# The trainers' payloads have no task field: the task is part of the URL they are given.
_TASK = Query(default=None, description="the task of every item, e.g. ?task=countdown (default math)")


@app.post("/get_reward", tags=["protocols"], response_model=OpenRLHFResponse)
async def get_reward(body: OpenRLHFRequest, task: TaskKind | None = _TASK) -> OpenRLHFResponse:
    """OpenRLHF remote reward model protocol (``--reward.remote_url``). Labels may be any JSON value;
    an unreadable label or an over-long text is that query's status (``status_ok`` 0), reward 0."""
    body.task = body.task or task
    spec = body.spec or RewardSpec()
    check_spec(spec)
    if len(body.query) > _settings.max_items:
        raise RequestError(
            413, ["body", "query"], f"{len(body.query)} items exceed the limit of {_settings.max_items}"
        )
    groups, where, refused = openrlhf_groups(body)
    return openrlhf_response(await score_groups(groups, spec, refused), where)


async def _slime(body: SlimeRequest, task: TaskKind | None) -> RewardResult:
    body.task = body.task or task
    spec = body.spec or RewardSpec()
    check_spec(spec)
    group, refused = slime_group(body)
    return (await score_groups([group], spec, [refused]))[0]


@app.post("/v1/slime/reward", tags=["protocols"])
async def slime_reward(body: SlimeRequest, task: TaskKind | None = _TASK) -> float:
    """slime remote reward protocol (``--rm-type remote_rm --rm-url .../v1/slime/reward``): slime takes
    the reply's JSON as the reward, so the reply is the total alone. Prompts may be chat messages."""
    return (await _slime(body, task)).rewards[0].total


@app.post("/v1/slime/reward/components", tags=["protocols"])
async def slime_reward_components(body: SlimeRequest, task: TaskKind | None = _TASK) -> dict[str, Any]:
    """The same score as a dict (``reward``, ``status``, ``detail``, every component) for slime's
    ``--reward-key reward`` (``--log-reward-category status`` then logs the status shares)."""
    return slime_components(await _slime(body, task))
