"""What the gateway checks at submission beyond the schema: each item's mode parameters (as the
rollout service will parse them), the reward spec (as the reward service will) and the policy version
asked for (as a rollout replica will look it up in the policy store). A job or run that would fail in
every worker is a 422 naming the field, not a 201 followed by a failed job.

A job's mode parameters are parsed here once per distinct item and stored in their resolved form
(``loom.contracts.modes.resolved_form``: the deployment's limits and the request's defaults filled
in), which the rollout worker takes without parsing again (docs/architecture.md, "Contracts")."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from gateway.auth import KEY_NAME
from gateway.models import JobRequest, TaskItem
from gateway.runs import to_request
from loom.contracts.modes import ModeError, ModeLimits, parse_mode_params, resolved_form
from loom.contracts.policies import PolicyMatch, is_namespace, is_run_namespace
from loom.contracts.rewards import RequestError, check_spec
from loom.contracts.settings import Settings
from loom.contracts.wire import Params, PolicyVersion
from loom.store import PolicyStoreError, open_policy_store

MAX_CHECKED = 1000  # distinct mode_params checked per submission (a built-in dataset's items differ
# only in their sentences, so the first ones stand for the rest)


@dataclass(frozen=True)
class Checked:
    """A submission's check: the 422 body of its first problem (None: none), the request to store
    (a job's with every item's mode parameters resolved; a run's as sent) and the distinct resolved
    mode parameters checked (what a run's charge reads: gateway/cost.py ``run_budget``)."""

    problem: dict[str, Any] | None
    request: Any
    resolved: tuple[Params, ...] = ()


def check_submission(
    items: Sequence[TaskItem],
    req: Any,
    settings: Settings,
    per_item_loc: str | None,
    owns_run: Callable[[str], bool] | None = None,
) -> Checked:
    """``req`` checked with its ``items``. ``per_item_loc``: the body field the items came from
    (``tasks``), so an item's own mode_params are reported at their index. A job's items (at most
    4096) are each resolved; a run's dataset may hold 100,000 items, whose first ``MAX_CHECKED``
    distinct mode_params are checked (a built-in dataset's items differ only in their sentences).
    ``owns_run``: whether a run's namespace is one of the requesting key's runs (a job may sample
    its own runs' versions)."""
    try:
        check_spec(req.reward, loc=("body", "reward"))
    except RequestError as exc:
        return Checked(exc.body(), req)
    if (problem := _process_problem(req)) is not None:
        return Checked(problem, req)
    field = "policy_version" if hasattr(req, "policy_version") else "initial_policy_version"
    namespace = getattr(req, "policy_namespace", None)
    # a run's base is that version itself (the learner starts its lineage from its files)
    exact = getattr(req, "policy_match", None) == "exact" or field == "initial_policy_version"
    match: PolicyMatch = "exact" if exact else "at_least"
    runs = owns_run if field == "policy_version" else None  # a run's base: the key's own versions only
    problem = policy_version_problem(getattr(req, field), field, settings, namespace, match, runs)
    if problem is not None:
        return Checked(problem, req)
    job = isinstance(req, JobRequest)
    limits = ModeLimits.from_settings(settings)
    sampling = req.generated_sampling()
    resolved: dict[str, Params] = {}
    for i, item in enumerate(items):
        request = to_request(item, req).model_copy(update={"sampling": sampling})
        key = repr(sorted(request.mode_params.items()))
        if key in resolved:
            continue
        if not job and len(resolved) >= MAX_CHECKED:
            break
        try:
            resolved[key] = resolved_form(parse_mode_params(request, limits))
        except ModeError as exc:
            loc: list[str | int] = ["body", "mode_params"]
            if per_item_loc is not None and item.mode_params:
                loc = ["body", per_item_loc, i, "mode_params"]
            body = {
                "error": "validation_error",
                "detail": [{"loc": loc, "msg": str(exc), "type": "mode_error"}],
            }
            return Checked(body, req)
    if not job:
        return Checked(None, req, tuple(resolved.values()))
    tasks = [
        item.model_copy(
            update={"mode_params": resolved[repr(sorted({**req.mode_params, **item.mode_params}.items()))]}
        )
        for item in items
    ]
    return Checked(None, req.model_copy(update={"prompts": None, "tasks": tasks, "mode_params": {}}))


def _process_problem(req: Any) -> dict[str, Any] | None:
    """A run whose estimator reads step scores (``step_grpo``, ``treerl`` with a process weight:
    docs/algorithms.md §5.4) and whose reward has no component of that name: a 422 now, not a refused
    batch at its first step."""
    p = getattr(req, "estimator_params", None)
    key = getattr(p, "process_key", None)
    if key is None or getattr(p, "process_weight", 1.0) == 0:
        return None
    if any(c.name == key for c in req.reward.components):
        return None
    msg = f"estimator {req.estimator!r} reads the step scores of reward component {key!r}: add it"
    return {
        "error": "validation_error",
        "detail": [{"loc": ["body", "reward", "components"], "msg": msg, "type": "value_error"}],
    }


def policy_version_problem(
    version: int | None,
    field: str,
    settings: Settings,
    namespace: str | None = None,
    match: PolicyMatch = "at_least",
    owns_run: Callable[[str], bool] | None = None,
) -> dict[str, Any] | None:
    """The 422 body when no rollout replica could serve ``version`` (``PolicyReader.find``, the
    lookup ``rollout_svc.rollout.catch_up`` loads by; version 0 is the base model every engine starts from;
    ``match`` "exact": that version itself). The gateway reads the same store as the rollout replicas:
    ``LOOM_POLICY_STORE`` (docker-compose mounts it) or, with ``LOOM_POLICY_STORE_URL``, the remote
    store's manifests (no file is pulled). A remote store that cannot answer is a 503
    ``policy_store_unavailable``. A ``namespace`` other than the requesting key's own is answered as
    a namespace without the version (another key's versions are invisible), but for one of its own
    runs' lineages where ``owns_run`` says so."""
    if not version:
        return None
    if namespace is not None and not visible(namespace, KEY_NAME.get(), owns_run):
        return _missing(version, field, None)
    store = open_policy_store(settings, create=False)
    try:
        if store.find(namespace, version, match) is not None:
            return None
        latest = store.find(namespace, None)
    except PolicyStoreError as exc:
        raise HTTPException(503, {"error": "policy_store_unavailable", "detail": str(exc)}) from exc
    return _missing(version, field, latest)


def visible(namespace: str, key: str | None, owns_run: Callable[[str], bool] | None) -> bool:
    """Whether key ``key`` may name ``namespace``: its own, or the lineage of one of its runs."""
    if is_run_namespace(namespace):
        return owns_run is not None and owns_run(namespace)
    return namespace == key and is_namespace(namespace)


def _missing(version: int, field: str, latest: PolicyVersion | None) -> dict[str, Any]:
    newest = "none is" if latest is None else f"the newest is {latest.version}"
    msg = f"policy version {version} is not in the policy store ({newest})"
    return {
        "error": "validation_error",
        "detail": [{"loc": ["body", field], "msg": msg, "type": "unknown_policy_version"}],
    }
