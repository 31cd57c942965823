"""What the gateway checks at submission beyond the schema: each item's mode parameters (as the
rollout service will parse them), the reward spec (as the reward service will) and the policy version
asked for (as a rollout replica will look it up in the policy store). A job or run that would fail in
every worker is a 422 naming the field, not a 201 followed by a failed job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import HTTPException

from gateway.auth import KEY_NAME
from gateway.models import TaskItem
from gateway.runs import to_request
from loom.contracts.modes import ModeError, ModeLimits, parse_mode_params
from loom.contracts.policies import PolicyMatch, is_namespace
from loom.contracts.rewards import RequestError, check_spec
from loom.contracts.settings import Settings
from loom.contracts.wire import PolicyVersion
from loom.store import PolicyStoreError, open_policy_store

MAX_CHECKED = 1000  # distinct mode_params checked per submission (a built-in dataset's items differ
# only in their sentences, so the first ones stand for the rest)


def submission_problem(
    items: Sequence[TaskItem], req: Any, settings: Settings, per_item_loc: str | None
) -> dict[str, Any] | None:
    """The 422 body for the first problem found, or None. ``per_item_loc``: the body field the items
    came from (``tasks``), so an item's own mode_params are reported at their index."""
    try:
        check_spec(req.reward, loc=("body", "reward"))
    except RequestError as exc:
        return exc.body()
    field = "policy_version" if hasattr(req, "policy_version") else "initial_policy_version"
    namespace = getattr(req, "policy_namespace", None)
    # a run's base is that version itself (the learner starts its lineage from its files)
    exact = getattr(req, "policy_match", None) == "exact" or field == "initial_policy_version"
    match: PolicyMatch = "exact" if exact else "at_least"
    problem = policy_version_problem(getattr(req, field), field, settings, namespace, match)
    if problem is not None:
        return problem
    limits = ModeLimits.from_settings(settings)
    seen: set[str] = set()
    for i, item in enumerate(items):
        request = to_request(item, req)
        key = repr(sorted(request.mode_params.items()))
        if key in seen:
            continue
        if len(seen) >= MAX_CHECKED:
            break
        seen.add(key)
        try:
            parse_mode_params(request, limits)
        except ModeError as exc:
            loc: list[str | int] = ["body", "mode_params"]
            if per_item_loc is not None and item.mode_params:
                loc = ["body", per_item_loc, i, "mode_params"]
            return {
                "error": "validation_error",
                "detail": [{"loc": loc, "msg": str(exc), "type": "mode_error"}],
            }
    return None


def policy_version_problem(
    version: int | None,
    field: str,
    settings: Settings,
    namespace: str | None = None,
    match: PolicyMatch = "at_least",
) -> dict[str, Any] | None:
    """The 422 body when no rollout replica could serve ``version`` (``PolicyReader.find``, the
    lookup ``rollout_svc.rollout.catch_up`` loads by; version 0 is the base model every engine starts from;
    ``match`` "exact": that version itself). The gateway reads the same store as the rollout replicas:
    ``LOOM_POLICY_STORE`` (docker-compose mounts it) or, with ``LOOM_POLICY_STORE_URL``, the remote
    store's manifests (no file is pulled). A remote store that cannot answer is a 503
    ``policy_store_unavailable``. A ``namespace`` other than the requesting key's own is answered as
    a namespace without the version (another key's versions are invisible)."""
    if not version:
        return None
    if namespace is not None and (namespace != KEY_NAME.get() or not is_namespace(namespace)):
        return _missing(version, field, None)
    store = open_policy_store(settings, create=False)
    try:
        if store.find(namespace, version, match) is not None:
            return None
        latest = store.find(namespace, None)
    except PolicyStoreError as exc:
        raise HTTPException(503, {"error": "policy_store_unavailable", "detail": str(exc)}) from exc
    return _missing(version, field, latest)


def _missing(version: int, field: str, latest: PolicyVersion | None) -> dict[str, Any]:
    newest = "none is" if latest is None else f"the newest is {latest.version}"
    msg = f"policy version {version} is not in the policy store ({newest})"
    return {
        "error": "validation_error",
        "detail": [{"loc": ["body", field], "msg": msg, "type": "unknown_policy_version"}],
    }
