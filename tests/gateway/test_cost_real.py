"""A tree job's cost through the real gateway process and the real ``loom worker rollout`` (torch
engine, tiny model) and ``loom worker reward``: with n=1 it is charged its tree budget at admission
(held while it runs: a second job is refused beside it) and settled, when it ends, to the
trajectories and tokens its groups produced (gateway/cost.py, docs/security.md "Quotas")."""

from __future__ import annotations

import sqlite3
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import API_KEYS, JOBS_KEY, GatewayProcess, real_services  # noqa: E402

TREE = {"initial": 2, "branches": 1, "continuations": 2, "strategy": "random", "min_distance": 0}
BUDGET = 2 * (1 + 1 * 1 * 2)  # initial x (1 + iterations x branches x continuations) per prompt
PROMPTS = 2


def _job(key: str) -> dict[str, Any]:
    return {
        "job_key": key,
        "prompts": [f"Compute {i}+3." for i in range(PROMPTS)],
        "sampling": {"n": 1, "max_tokens": 24, "temperature": 1.0, "seed": 5},
        "mode": "tree",
        "mode_params": TREE,
    }


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_a_tree_job_with_n_1_is_charged_its_tree_and_settled_to_what_it_produced(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path
) -> None:
    broker_env.extra_env.update(LOOM_API_KEYS=API_KEYS, LOOM_GATEWAY_QUOTA_SAMPLES=str(PROMPTS * BUDGET))
    with real_services(broker_env, loom_worker, tmp_path, services=("reward",)) as gw:
        _scenario(gw, broker_env, loom_worker, tmp_path)


def _scenario(gw: GatewayProcess, broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path) -> None:
    first = gw.post("/v1/jobs", JOBS_KEY, _job("tree"))
    assert first.status_code == 201, first.text
    job_id = first.json()["id"]
    # no rollout worker yet: the job is running and holds its whole tree budget (n=1 held 1 before)
    r = gw.post("/v1/jobs", JOBS_KEY, _job("tree-2"))
    assert r.status_code == 429 and r.json()["in_use"] == PROMPTS * BUDGET, r.text
    loom_worker("rollout", broker_env)
    deadline = time.monotonic() + 180
    while (view := gw.get(f"/v1/jobs/{job_id}", JOBS_KEY).json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, view
        time.sleep(0.2)
    assert view["status"] == "succeeded", (view, gw.log_path.read_text()[-3000:])
    trajectories = [t for g in view["groups"] for t in g["group"]["trajectories"]]
    assert PROMPTS * 2 < len(trajectories) <= PROMPTS * BUDGET  # the trees branched
    tokens = sum(sum(t["loss_mask"]) if t["loss_mask"] else len(t["completion_ids"]) for t in trajectories)
    with sqlite3.connect(Path(broker_env.settings.data_dir) / "gateway.sqlite") as db:
        settled = db.execute("SELECT samples, tokens FROM jobs WHERE id=?", (job_id,)).fetchone()
    assert settled == (len(trajectories), tokens)
    # the charge ended with the job: the refused job now fits
    assert gw.post("/v1/jobs", JOBS_KEY, _job("tree-2")).status_code == 201
