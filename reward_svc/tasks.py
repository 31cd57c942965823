"""Celery tasks of the reward service (queue ``reward``): thin shells over the core modules.

``reward.score_group`` scores one group with the same core as the HTTP API. Its verifier pool (forked
processes with per-item deadlines) is one per worker process, started on first use and shared by the
task threads (``LOOM_REWARD_POOL=threads``, the default) or owned by the prefork child that runs the
task, so a hostile answer costs its per-item deadline there too. Publish it with ``submit_group``:
the task id is derived from the group id and the spec, so a redelivered or re-sent group returns the
stored result (LoomTask).

``reward.score_groups`` scores several groups in one task (the gateway's groups whose generation
ended together: one message, one claim instead of one per group; gateway/pipeline.py). Each member
is ``[key, group, spec]`` and its result is stored under its own ``key`` as soon as it is scored, as
if ``reward.score_group`` had run under that key: a member whose key already has a result is
skipped, a member that fails gets a FAILURE under its key (the others are scored), every member's
math items go to the verifier pool together (a hostile answer costs its own group its per-item
deadline, not the others), and the message is acknowledged after the last member, so a killed worker's
batch is redelivered and only the members without a result are scored again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

from celery import Celery, Task, states
from celery.result import AsyncResult

from loom.contracts.tasks import MATCH_TEXTS, SCORE_GROUP, SCORE_GROUPS
from loom.contracts.wire import Group, RewardSpec
from loom.queue import make_celery, send, task_of
from loom.results import stored_metas
from loom.runtime import Shared
from loom.timeline import mark

celery_app = make_celery("reward")


def _make_verifier() -> Any:
    from loom.contracts.reward_settings import get_reward_settings
    from reward_svc.pool import VerifierPool

    return VerifierPool.from_settings(get_reward_settings())


_verifier = Shared(_make_verifier).get  # one verifier pool per worker process, started on first use


def _make_sandbox_client() -> Any:
    from loom.clients.sandbox import SandboxClient
    from loom.contracts.reward_settings import get_reward_settings

    return SandboxClient(get_reward_settings().sandbox_url or None)


# the process's sandbox client (loom/clients/sandbox.py): code rewards run their tests in the sandbox
# service, never in the reward process
sandbox_client = Shared(_make_sandbox_client).get


def _make_judge_client() -> Any:
    from loom.clients.judge import JudgeClient
    from loom.contracts.reward_settings import get_reward_settings

    return JudgeClient(get_reward_settings().judges)


# the process's judge client (loom/clients/judge.py): its limits and cache are the process's
judge_client = Shared(_make_judge_client).get


def _ask_judge_blocking(asks: Any) -> Any:
    return asyncio.run(judge_client().ask_batch_once(asks))


def _parsed(group: dict[str, Any], spec: dict[str, Any] | None) -> tuple[Group, RewardSpec]:
    """A reward task's ``Group`` and ``RewardSpec`` from their JSON, the spec checked."""
    from loom.contracts.rewards import check_spec

    s = RewardSpec.model_validate(spec or {})
    check_spec(s)
    return Group.model_validate(group), s


@task_of(celery_app, SCORE_GROUP)
def score_group_task(group: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score one group: ``Group`` and ``RewardSpec`` as JSON in, ``RewardResult`` as JSON out."""
    from reward_svc.core import score_group

    key = score_group_task.request.id or ""
    mark("score_start", key)
    out = score_group(
        *_parsed(group, spec),
        _verifier().check_many,
        run_code=sandbox_client().run_batch,
        ask_judge=_ask_judge_blocking,
    ).model_dump(mode="json")
    mark("score_end", key)
    return out


@task_of(celery_app, SCORE_GROUPS, bind=True, ignore_result=True)
def score_groups_task(self: Task, members: list[list[Any]]) -> dict[str, int]:
    """Score each ``[key, group, spec]`` of ``members``; its ``RewardResult`` (or failure) is stored
    under ``key``. Returns how many were scored and skipped (not stored: the members' keys are read)."""
    mark("batch_start", self.request.id or "")
    backend = self.backend
    keys = [str(m[0]) for m in members]
    todo: list[str] = []
    try:
        stored = stored_metas(self.app, keys)
        for key in keys:
            if stored.get(key, {}).get("status") != states.SUCCESS and key not in todo:
                todo.append(key)
        asyncio.run(
            _score_members(backend, {str(m[0]): (m[1], m[2]) for m in members if str(m[0]) in todo}, todo)
        )
    except Exception as exc:  # no member is left without a result (a killed worker's batch is redelivered)
        for key in todo:
            if backend.get_task_meta(key).get("status") not in states.READY_STATES:
                backend.store_result(key, exc, states.FAILURE)
        raise
    return {"scored": len(todo), "skipped": len(keys) - len(todo)}


async def _score_members(backend: Any, members: dict[str, tuple[Any, Any]], order: list[str]) -> None:
    """Plan every member, verify all their math items in the pool at once, and store each member's
    result (or its error) as soon as its own items are answered."""
    from reward_svc.core import ascore_group

    pool = _verifier()

    async def one(key: str) -> None:
        group, spec = members[key]
        mark("score_start", key)
        try:
            result = await ascore_group(
                *_parsed(group, spec),
                pool.acheck_many,
                run_code=sandbox_client().arun_batch,
                ask_judge=judge_client().ask_batch,
            )
        except Exception as exc:  # this member fails, as its own score_group task would
            backend.store_result(key, exc, states.FAILURE)
        else:
            backend.store_result(key, result.model_dump(mode="json"), states.SUCCESS)
        mark("score_end", key)

    await asyncio.gather(*(one(key) for key in order))


@task_of(celery_app, MATCH_TEXTS)
def match_texts_task(request: dict[str, Any]) -> dict[str, Any]:
    """Does each text state the gold answer? ``MatchRequest`` JSON in, ``MatchResponse`` JSON out."""
    from loom.contracts.rewards import check_timeout
    from reward_svc.match import MatchRequest, finish_matches, plan_matches

    req = MatchRequest.model_validate(request)
    check_timeout(req.timeout_s, ["timeout_s"])
    decided, math = plan_matches(req)
    verdicts = _verifier().check_many([m for _, m in math], req.timeout_s) if math else []
    return finish_matches(decided, math, verdicts).model_dump(mode="json")


def task_key(group: Group, spec: RewardSpec) -> str:
    digest = hashlib.sha256(json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[
        :16
    ]
    return f"reward:{group.id}:{digest}"


def submit_group(group: Group, spec: RewardSpec | None = None, app: Celery | None = None) -> AsyncResult:
    """Publish ``reward.score_group`` keyed by group id (and spec): idempotent by group."""
    spec = spec or RewardSpec()
    return send(app or celery_app, SCORE_GROUP, group, spec, key=task_key(group, spec))
