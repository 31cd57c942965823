"""verl custom reward functions that score through Loom's reward service over HTTP.

verl 0.9.1 (docs/interop-reward.md)::

    reward.custom_reward_function.path=pkg://loom.clients.verl
    reward.custom_reward_function.name=compute_score
    reward.reward_manager.name=naive            # or remote: the same function, in Ray worker processes

The service URL is ``LOOM_REWARD_URL`` or the reward kwarg ``loom_url``; the components are
``LOOM_REWARD_COMPONENTS`` (JSON list of ``{name, weight, params}``) or the reward kwarg
``loom_components``; default accuracy. Reward kwargs (``reward.custom_reward_function.reward_kwargs``)
reach every Ray worker, environment variables only where Ray passes them on. The result is a dict:
``score`` is the reward, the other keys (every component, ``status_ok``) are logged by verl, the same
keys for every sample (verl stacks them into arrays).

``compute_score_batch`` is the batch form (verl's legacy ``BatchRewardManager``): samples sharing
``extra_info["uid"]`` form one group, scored in one HTTP call. verl passes numpy object arrays.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from loom.clients.reward import RewardClient, default_url
from loom.contracts.wire import Group, RewardResult, RewardSpec, TaskKind, Trajectory
from loom.interop import LabelError, label_text, plain

_clients: dict[str, RewardClient] = {}


def _get_client(url: str | None) -> RewardClient:
    url = url or default_url()
    if url not in _clients:
        _clients[url] = RewardClient(url)
    return _clients[url]


def _spec(components: Any) -> RewardSpec:
    raw = components if components is not None else os.environ.get("LOOM_REWARD_COMPONENTS")
    if raw is None:
        return RewardSpec()
    return RewardSpec(components=json.loads(raw) if isinstance(raw, str) else plain(raw))


def _task(data_source: Any, extra_info: Any) -> TaskKind | None:
    task = extra_info.get("task") if isinstance(extra_info, dict) else None
    if task:
        return str(task)  # type: ignore[return-value]
    return "countdown" if "countdown" in str(data_source or "").lower() else None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    loom_url: str | None = None,
    loom_components: Any = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl's per-sample reward function (the ``naive`` and ``remote`` reward managers)."""
    return compute_score_batch(
        [data_source],
        [solution_str],
        [ground_truth],
        [extra_info],
        loom_url=loom_url,
        loom_components=loom_components,
    )[0]


def compute_score_batch(
    data_sources: Sequence[Any],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any] | None = None,
    *,
    loom_url: str | None = None,
    loom_components: Any = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """verl's batch reward function: any sequences (numpy object arrays included). Samples sharing
    ``extra_info["uid"]`` (verl's prompt id) form one group, so group-relative components see the
    whole group; one HTTP call for the batch. A label no component can read scores 0 (``status_ok``
    0), the rest of the batch as usual."""
    spec = _spec(loom_components)
    n = len(solution_strs)
    infos = list(extra_infos) if extra_infos is not None else [None] * n
    groups: dict[str, Group] = {}
    where: list[tuple[str, int] | None] = []
    rows = zip(data_sources, solution_strs, ground_truths, infos, strict=True)
    for i, (ds, sol, gt, info) in enumerate(rows):
        try:
            label = label_text(gt)
        except LabelError:
            where.append(None)
            continue
        uid = info.get("uid") if isinstance(info, dict) else None
        key = f"uid:{uid}" if uid is not None else f"sample:{i}"
        if key not in groups:
            groups[key] = Group(id=f"verl-{len(groups)}", label=label, task=_task(ds, info))
        g = groups[key]
        g.trajectories.append(Trajectory(id=f"s{i}", group_id=g.id, text=str(sol)))
        where.append((key, len(g.trajectories) - 1))
    keys = list(groups)
    scored = _get_client(loom_url).score([groups[k] for k in keys], spec) if keys else []
    results: dict[str, RewardResult] = dict(zip(keys, scored, strict=True))
    zero = {"score": 0.0, **{c.name: 0.0 for c in spec.components}, "status_ok": 0.0}
    out = []
    for w in where:
        if w is None:
            out.append(dict(zero))
            continue
        r = results[w[0]].rewards[w[1]]
        out.append({"score": r.total, **r.components, "status_ok": float(r.status == "ok")})
    return out
