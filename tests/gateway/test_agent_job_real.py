"""An agent job through the real gateway process, ``loom worker rollout`` (torch engine, tiny model)
and ``loom worker reward``: its mode parameters are resolved at submission, the rollout worker runs
the episodes, and the stored group carries each episode's turn segments, its env mask and why it
ended; the job is charged every turn's budget and settled to what it produced (gateway/cost.py).
The tiny model calls no tool on its own, so its episodes end after one turn: the turns, tools and
observations themselves are tests/rollout_modes/test_agent.py's and tests/vllm_server/test_agent.py's."""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import JOBS_KEY, real_services, wait_until  # noqa: E402

AGENT = {"max_turns": 3, "max_total_tokens": 64, "parser": "function"}
ENDS = {"no_tool_call", "max_turns", "max_total_tokens", "max_turn_tokens", "context", "deadline"}


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_an_agent_job_runs_through_the_stack_and_is_settled(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path
) -> None:
    body = {
        "job_key": "agent",
        "prompts": ["Compute 2+3.", "Compute 4+1."],
        "sampling": {"n": 2, "max_tokens": 16, "temperature": 1.0, "seed": 3},
        "mode": "agent",
        "mode_params": AGENT,
    }
    with real_services(broker_env, loom_worker, tmp_path, services=("rollout", "reward")) as gw:
        created = gw.post("/v1/jobs", JOBS_KEY, body)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]

        def ended() -> Any:
            view = gw.get(f"/v1/jobs/{job_id}", JOBS_KEY).json()
            return view if view["status"] in ("succeeded", "failed") else None

        view = wait_until(ended, 180, "the agent job's end")
        assert view["status"] == "succeeded", (view, gw.log_path.read_text()[-3000:])
        trajectories = [t for g in view["groups"] for t in g["group"]["trajectories"]]
        assert len(trajectories) == 4
        for t in trajectories:
            assert t["stop_reason"] in ENDS, t["stop_reason"]
            kinds = [s["kind"] for s in t["segments"]]
            assert kinds and kinds[0] == "turn" and set(kinds) <= {"turn", "observation"}, kinds
            assert len(t["logprobs"]) == len(t["completion_ids"]) <= AGENT["max_total_tokens"]
            mask = t["loss_mask"] or [1] * len(t["completion_ids"])
            assert len(mask) == len(t["completion_ids"])
        tokens = sum(sum(t["loss_mask"] or [1] * len(t["completion_ids"])) for t in trajectories)
        with sqlite3.connect(Path(broker_env.settings.data_dir) / "gateway.sqlite") as db:
            settled = db.execute("SELECT samples, tokens FROM jobs WHERE id=?", (job_id,)).fetchone()
        assert settled == (4, tokens)
