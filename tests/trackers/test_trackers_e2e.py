"""A demo-sized run of the REAL services (``loom worker rollout`` with the torch engine and the tiny
model, ``loom worker reward``, ``loom worker learner``, the gateway API process) with all three
trackers named in its request: the TensorBoard event files, the MLflow file store and the W&B offline
run it leaves are read back with the libraries' own readers and hold the series the gateway serves at
``/v1/runs/{id}/metrics``, step by step."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from helpers import RUNS_KEY, real_services, start_run, wait_run_succeeded, wait_until  # noqa: E402
from readers import mlflow_series, tensorboard_scalars, tensorboard_texts, wandb_history  # noqa: E402

STEPS = 2
RUN = {
    "run_key": "trackers-e2e",
    "dataset": {"builtin": "countdown", "size": 16, "seed": 3},
    # as in tests/gateway/test_resume_real.py: the length term gives groups a non-zero advantage so
    # that steps really train (accuracy alone is nearly always 0 for the tiny model on Countdown)
    "sampling": {"n": 4, "max_tokens": 48, "temperature": 1.0},
    "reward": {"components": [{"name": "accuracy", "weight": 1.0}, {"name": "length_kimi", "weight": 0.5}]},
    "schedule": {"steps": STEPS, "batch_size": 2, "staleness": 1},
    "trackers": [{"name": "tensorboard"}, {"name": "wandb"}, {"name": "mlflow", "project": "e2e"}],
}
KEYS = [
    "reward_mean",
    "reward/accuracy",
    "reward/length_kimi",
    "accuracy",
    "length_mean",
    "policy_version",
    "staleness",
    "tokens_per_s",
]


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_a_real_run_fills_tensorboard_mlflow_and_wandb_with_its_metrics(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path
) -> None:
    with real_services(broker_env, loom_worker, tmp_path) as gw:
        run_id = start_run(gw, RUN)
        wait_run_succeeded(gw, run_id, 240)
        metrics = gw.get(f"/v1/runs/{run_id}/metrics", RUNS_KEY).json()
        run_dir = tmp_path / "loom-data" / "runs" / run_id / "trackers"
        # the trackers close after the run's status is recorded: W&B's offline file is complete then
        rows = wait_until(
            lambda: len(wandb_history(run_dir / "wandb")) == STEPS and wandb_history(run_dir / "wandb"),
            60,
            "W&B history",
        )

    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert any("learner/loss" in m for m in metrics), ("no step trained", metrics)
    expected = {k: [(m["step"], pytest.approx(float(m[k]))) for m in metrics] for k in KEYS}
    trained = [m["step"] for m in metrics if "learner/loss" in m]
    expected["learner/loss"] = [
        (m["step"], pytest.approx(m["learner/loss"])) for m in metrics if m["step"] in trained
    ]

    tb = tensorboard_scalars(run_dir / "tensorboard")
    assert {k: tb[k] for k in expected} == expected
    texts = tensorboard_texts(run_dir / "tensorboard")
    assert [s for s, _ in texts] == list(range(STEPS)) and "| group_id |" in texts[0][1]

    uri = (run_dir / "mlflow").resolve().as_uri()
    assert mlflow_series(uri, run_id, list(expected)) == expected

    assert {k: [(r["_step"], pytest.approx(r[k])) for r in rows if k in r] for k in expected} == expected
