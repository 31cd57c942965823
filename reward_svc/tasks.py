"""Celery tasks of the reward service (queue ``reward``): thin shells over the core modules.

``reward.score_group`` scores one group with the same core as the HTTP API. Its verifier pool (forked
processes with per-item deadlines) is one per worker process, started on first use and shared by the
task threads (``LOOM_REWARD_POOL=threads``, the default) or owned by the prefork child that runs the
task, so a hostile answer costs its per-item deadline there too. Publish it with ``submit_group``:
the task id is derived from the group id and the spec, so a redelivered or re-sent group returns the
stored result (LoomTask).
"""

from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

from celery import Celery
from celery.result import AsyncResult

from loom.contracts.wire import Group, RewardSpec
from loom.queue import make_celery, send
from loom.timeline import mark

celery_app = make_celery("reward")

_lock = threading.Lock()
_pool: Any = None


def _verifier() -> Any:
    global _pool
    with _lock:
        if _pool is None:
            from loom.contracts.reward_settings import get_reward_settings
            from reward_svc.pool import VerifierPool

            _pool = VerifierPool.from_settings(get_reward_settings())
        return _pool


@celery_app.task(name="reward.score_group")
def score_group_task(group: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """Score one group: ``Group`` and ``RewardSpec`` as JSON in, ``RewardResult`` as JSON out."""
    from loom.contracts.rewards import check_spec
    from reward_svc.core import score_group

    key = score_group_task.request.id or ""
    mark("score_start", key)
    g = Group.model_validate(group)
    s = RewardSpec.model_validate(spec or {})
    check_spec(s)
    out = score_group(g, s, _verifier().check_many).model_dump(mode="json")
    mark("score_end", key)
    return out


@celery_app.task(name="reward.match_texts")
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
    return send(
        app or celery_app,
        "reward.score_group",
        group.model_dump(mode="json"),
        spec.model_dump(mode="json"),
        key=task_key(group, spec),
    )
