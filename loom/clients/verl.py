"""verl custom reward functions that score through Loom's reward service over HTTP.

In a verl config::

    custom_reward_function:
      path: <site-packages>/loom/clients/verl.py
      name: compute_score          # or compute_score_batch with the batch reward manager

The service URL is ``LOOM_REWARD_URL``; the components are ``LOOM_REWARD_COMPONENTS`` (JSON list of
``{name, weight, params}``; default accuracy). The result is a dict: ``score`` is the reward, the other
keys (every component, ``status_ok``) are logged by verl.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loom.clients.reward import RewardClient
from loom.schemas import Group, RewardSpec, Trajectory

_client: RewardClient | None = None


def _get_client() -> RewardClient:
    global _client
    if _client is None:
        _client = RewardClient()
    return _client


def _spec() -> RewardSpec:
    raw = os.environ.get("LOOM_REWARD_COMPONENTS")
    return RewardSpec(components=json.loads(raw)) if raw else RewardSpec()


def _label(ground_truth: Any) -> str:
    return ground_truth if isinstance(ground_truth, str) else json.dumps(ground_truth)


def _task(data_source: str, extra_info: dict[str, Any] | None) -> str | None:
    task = (extra_info or {}).get("task")
    if task:
        return str(task)
    ds = (data_source or "").lower()
    return "countdown" if "countdown" in ds else None


def _as_dict(total: float, components: dict[str, float], status: str) -> dict[str, Any]:
    return {"score": total, **components, "status_ok": float(status == "ok")}


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """verl's per-sample reward function."""
    return compute_score_batch([data_source], [solution_str], [ground_truth], [extra_info])[0]


def compute_score_batch(
    data_sources: list[str],
    solution_strs: list[str],
    ground_truths: list[Any],
    extra_infos: list[dict[str, Any] | None] | None = None,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """verl's batch reward function: samples sharing ``extra_info["uid"]`` (verl's prompt id) form one
    group, so group-relative components see the whole group; one HTTP call for the batch."""
    infos = extra_infos or [None] * len(solution_strs)
    groups: dict[str, Group] = {}
    where: list[tuple[str, int]] = []
    for i, (ds, sol, gt, info) in enumerate(
        zip(data_sources, solution_strs, ground_truths, infos, strict=True)
    ):
        key = str((info or {}).get("uid", f"sample-{i}"))
        if key not in groups:
            gid = f"verl-{len(groups)}"
            groups[key] = Group(id=gid, label=_label(gt), task=_task(ds, info))  # type: ignore[arg-type]
        g = groups[key]
        g.trajectories.append(Trajectory(id=f"s{i}", group_id=g.id, text=sol))
        where.append((key, len(g.trajectories) - 1))
    keys = list(groups)
    results = dict(zip(keys, _get_client().score([groups[k] for k in keys], _spec()), strict=True))
    out = []
    for key, ti in where:
        r = results[key].rewards[ti]
        out.append(_as_dict(r.total, r.components, r.status))
    return out
