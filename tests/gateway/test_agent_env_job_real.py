"""An agent job with an environment through the real gateway process, ``loom worker rollout`` (torch
engine, tiny model), ``loom worker env`` and ``loom worker reward`` on the embedded broker (``loom
up``'s default): the rollout worker opens each episode's ``countdown`` on the env worker, every turn is
a step there, and the stored group carries the per-turn rewards and the environment's end. The tiny
model never answers correctly, so each episode ends ``env_done`` after ``max_tries`` turns."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import JOBS_KEY, real_services, wait_until  # noqa: E402

AGENT = {
    "max_turns": 4,
    "max_total_tokens": 256,
    "environment": "countdown",
    "env_options": {"numbers": [1, 2, 3], "target": 6, "max_tries": 2},
}


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_an_agent_job_in_an_environment_runs_through_the_env_tier(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path
) -> None:
    body = {
        "job_key": "agent-env",
        "prompts": ["Reach 6 with 1, 2 and 3."],
        "sampling": {"n": 2, "max_tokens": 8, "temperature": 1.0, "seed": 3},
        "mode": "agent",
        "mode_params": AGENT,
    }
    with real_services(broker_env, loom_worker, tmp_path, services=("rollout", "env", "reward")) as gw:
        created = gw.post("/v1/jobs", JOBS_KEY, body)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]

        def ended() -> Any:
            view = gw.get(f"/v1/jobs/{job_id}", JOBS_KEY).json()
            return view if view["status"] in ("succeeded", "failed") else None

        view = wait_until(ended, 180, "the agent job's end")
        assert view["status"] == "succeeded", (view, gw.log_path.read_text()[-3000:])
        (group,) = [g["group"] for g in view["groups"]]
        assert len(group["trajectories"]) == 2
        for t in group["trajectories"]:
            turns = [s for s in t["segments"] if s["kind"] == "turn"]
            (obs,) = [s for s in t["segments"] if s["kind"] == "observation"]
            assert t["stop_reason"] == "env_done" and t["meta"]["turn_rewards"] == [0.0, 0.0]
            assert [s["meta"]["env_status"] for s in turns] == ["ok", "ok"]
            assert obs["meta"]["status"] == "ok" and obs["meta"]["env"] == "countdown"
            assert t["loss_mask"][obs["start"] : obs["end"]] == [0] * (obs["end"] - obs["start"])
            assert sum(t["loss_mask"]) == sum(s["end"] - s["start"] for s in turns)
