"""Killing the gateway mid-run with the REAL services as stages (issue 9 "Must show"): real
``loom worker rollout`` (torch engine, tiny model), ``loom worker reward`` and ``loom worker learner``
processes, the real gateway API process killed with SIGKILL after >= 1 completed step and restarted.
The run must finish with steps exactly 0..N-1, one policy version per trained step, and the learner's
policy store must hold exactly one version per trained step (nothing trained twice)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loom.store import PolicyStore

sys.path.insert(0, str(Path(__file__).parent))
from helpers import RUNS_KEY, real_services, start_run, trained_steps, wait_run_succeeded, wait_until  # noqa: E402

STEPS = 4
RUN = {
    "run_key": "resume-real",
    "dataset": {"builtin": "countdown", "size": 32, "seed": 3},
    "sampling": {"n": 4, "max_tokens": 48, "temperature": 1.0},
    # accuracy alone is nearly always 0 for the tiny model on Countdown at 48 tokens; the length term
    # gives groups a non-zero advantage so that steps really train
    "reward": {"components": [{"name": "accuracy", "weight": 1.0}, {"name": "length_kimi", "weight": 0.5}]},
    "estimator": "grpo",
    "loss": {"lr": 1e-4},
    "schedule": {"steps": STEPS, "batch_size": 2, "staleness": 1},
}


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_killed_gateway_resumes_a_run_of_real_services(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path
) -> None:
    with real_services(broker_env, loom_worker, tmp_path) as gw:
        run_id = start_run(gw, RUN)
        seen = wait_until(
            lambda: (v := gw.get(f"/v1/runs/{run_id}", RUNS_KEY).json())["completed_steps"] >= 1 and v,
            120,
            "the first completed step",
            every=0.05,
        )
        gw.kill()  # SIGKILL: the next step's generation (and maybe its training) is in flight
        assert seen["status"] == "running" and seen["completed_steps"] < STEPS, seen

        gw.start()
        again = gw.post("/v1/runs", RUNS_KEY, RUN)  # idempotent by run_key: the same run, resumed
        assert again.status_code == 200 and again.json()["id"] == run_id
        view = wait_run_succeeded(gw, run_id, 120)
        metrics = gw.get(f"/v1/runs/{run_id}/metrics", RUNS_KEY).json()

    # every step exactly once, in order: none repeated, none skipped across the restart
    assert [m["step"] for m in metrics] == list(range(STEPS))
    # the policy version moves by exactly one per step that trained, and not at all otherwise
    trained = trained_steps(metrics)
    assert trained, "no step trained: the test would show nothing"
    assert view["policy_version"] == metrics[-1]["policy_version"] == len(trained)
    # the learner published exactly one version per trained step, each for a distinct step, all in
    # the run's own lineage (docs/security.md "Runs' lineages")
    assert view["lineage"]["namespace"] == run_id and view["versions"] == list(range(1, len(trained) + 1))
    root = PolicyStore(tmp_path / "loom-data" / "policy")
    assert root.versions() == []
    store = root.namespace(run_id)
    assert store.versions() == list(range(1, len(trained) + 1))
    published = [store.get(v) for v in store.versions()]
    assert [p.meta["step"] for p in published if p is not None] == trained
