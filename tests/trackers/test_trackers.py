"""Trackers driven by the run loop (gateway/runs.py) with in-process stage stand-ins: the loop's own
wiring is under test here (test_trackers_e2e.py drives the real services). Every tracker's files are
read back with the library's own reader and must hold the run's stored metrics, step by step; a
tracker that fails never stops the run."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).parent))
from readers import (  # noqa: E402
    mlflow_run,
    mlflow_series,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_history,
)

from gateway import models  # noqa: E402
from gateway.models import RunRequest, TrackerSpec  # noqa: E402
from gateway.runs import RunLoop  # noqa: E402
from gateway.state import GatewayState  # noqa: E402
from gateway.stepmetrics import step_metrics, step_samples  # noqa: E402
from gateway.trackers import Trackers, parse_setting, resolve, series  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.contracts.wire import (  # noqa: E402
    Group,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    StepResult,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
)

STEPS = 3


class Stages:
    """Two trajectories a group: one right (accuracy 1), one wrong; the learner reports a loss that
    falls with the step."""

    async def generate(self, key: str, request: RolloutRequest) -> Group:
        trajs = [
            Trajectory(id=f"{key}.{i}", group_id=key, completion_ids=[1] * (3 + i), text=f"answer {i}")
            for i in range(2)
        ]
        return Group(id=key, prompt=request.prompt, trajectories=trajs)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        rewards = [
            TrajectoryReward(
                trajectory_id=t.id,
                total=1.0 - i + 0.1,
                components={"accuracy": 1.0 - i, "format": 0.1},
                status="ok" if i == 0 else "no_answer",
            )
            for i, t in enumerate(group.trajectories)
        ]
        return RewardResult(group_id=group.id, rewards=rewards)

    async def train(self, key: str, batch: TrainBatch) -> StepResult:
        metrics = {"loss": 1.0 / (batch.step + 1), "clip_frac": 0.01 * batch.step}
        return StepResult(step=batch.step, policy_version=batch.step + 1, metrics=metrics, n_tokens=7)

    async def cancel(self, scope: str) -> int:
        return 0


def _run(
    tmp_path: Path, trackers: list[dict[str, Any]] | None, loop_trackers: Trackers | None = None
) -> tuple[GatewayState, str, str]:
    state = GatewayState(tmp_path / "gw.sqlite")
    body: dict[str, Any] = {
        "dataset": {"builtin": "arith", "size": 8},
        "sampling": {"n": 2},
        "schedule": {"steps": STEPS, "batch_size": 2, "staleness": 0},
    }
    if trackers is not None:
        body["trackers"] = trackers
    req = RunRequest.model_validate(body)
    run_id, _ = state.runs.create(owner="me", request=req)
    loop = RunLoop(run_id, state, Stages(), tmp_path, trackers=loop_trackers)  # type: ignore[arg-type]
    return state, run_id, asyncio.run(loop.run())


def test_a_run_writes_its_metrics_to_tensorboard_wandb_and_mlflow(tmp_path: Path) -> None:
    specs: list[dict[str, Any]] = [
        {"name": "tensorboard"},
        {"name": "wandb", "project": "loom-test"},
        {"name": "mlflow", "samples_per_step": 1},
    ]
    state, run_id, status = _run(tmp_path, specs)
    assert status == "succeeded"
    stored = state.runs.steps(run_id)
    assert [m["step"] for m in stored] == list(range(STEPS))
    keys = [
        "reward_mean",
        "reward/accuracy",
        "reward/format",
        "status/no_answer",
        "learner/loss",
        "learner/clip_frac",
        "policy_version",
        "staleness",
        "tokens_per_s",
        "advantage_abs_mean",
    ]
    expected = {k: [(m["step"], pytest.approx(float(m[k]))) for m in stored] for k in keys}
    # the per-component means of the stand-in's rewards: accuracy 1 and 0, format 0.1 each
    assert [v for _, v in expected["reward/accuracy"]] == [0.5] * STEPS
    assert [v for _, v in expected["learner/loss"]] == [1.0, 0.5, pytest.approx(1 / 3)]

    run_dir = tmp_path / "runs" / run_id
    tb = tensorboard_scalars(run_dir / "trackers" / "tensorboard")
    assert {k: tb[k] for k in keys} == expected
    assert set(tb) == set(series(stored[0])), "every numeric metric is a TensorBoard series"
    texts = tensorboard_texts(run_dir / "trackers" / "tensorboard")
    assert [s for s, _ in texts] == list(range(STEPS))
    assert "answer 0" in texts[0][1] and "no_answer" not in texts[0][1].split("\n")[2]

    uri = (run_dir / "trackers" / "mlflow").resolve().as_uri()
    assert mlflow_series(uri, run_id, keys) == expected
    client, mlflow_id = mlflow_run(uri, run_id)
    assert client.get_run(mlflow_id).info.status == "FINISHED"
    samples = client.download_artifacts(mlflow_id, "samples/step_000002.json", str(tmp_path))
    logged = json.loads(Path(samples).read_text())
    assert logged["step"] == 2 and len(logged["samples"]) == 1  # samples_per_step: 1
    assert logged["samples"][0]["components"] == {"accuracy": 1.0, "format": 0.1}

    rows = wandb_history(run_dir / "trackers" / "wandb")
    assert [r["_step"] for r in rows] == list(range(STEPS))
    assert {k: [(r["_step"], pytest.approx(r[k])) for r in rows] for k in keys} == expected
    # the samples: a W&B Table a step, its rows in the run's files
    assert [(r["samples/_type"], r["samples/nrows"]) for r in rows] == [("table-file", 2)] * STEPS
    (files,) = (run_dir / "trackers" / "wandb").glob("wandb/offline-run-*/files")
    table = json.loads((files / rows[0]["samples/path"]).read_text())
    assert table["columns"][:3] == ["group_id", "prompt", "response"] and table["data"][0][2] == "answer 0"


def test_a_tracker_that_raises_does_not_stop_the_run(tmp_path: Path) -> None:
    class Broken:
        name = "broken"
        calls = 0

        def log(self, step: int, metrics: dict[str, float], samples: Sequence[dict[str, Any]]) -> None:
            Broken.calls += 1
            raise OSError(28, "No space left on device")

        def close(self, status: str) -> None:
            raise OSError(28, "No space left on device")

    class Kept:
        name = "kept"

        def __init__(self) -> None:
            self.steps: list[int] = []

        def log(self, step: int, metrics: dict[str, float], samples: Sequence[dict[str, Any]]) -> None:
            self.steps.append(step)

        def close(self, status: str) -> None:
            self.steps.append(-1)

    kept = Kept()
    trackers = Trackers([Broken(), kept])
    state, run_id, status = _run(tmp_path, None, trackers)
    assert status == "succeeded"
    assert [m["step"] for m in state.runs.steps(run_id)] == list(range(STEPS))
    assert Broken.calls == STEPS and trackers.failures == {"broken": STEPS, "kept": 0}
    assert kept.steps == [*range(STEPS), -1]  # the other tracker got every step


def test_a_tracker_that_cannot_open_is_left_out_and_the_run_goes_on(tmp_path: Path) -> None:
    # a real failure, not a stand-in: a file is in the way of the TensorBoard folder
    state, run_id, status = _run_with_blocked_dir(tmp_path)
    assert status == "succeeded"
    assert [m["step"] for m in state.runs.steps(run_id)] == list(range(STEPS))


def _run_with_blocked_dir(tmp_path: Path) -> tuple[GatewayState, str, str]:
    state = GatewayState(tmp_path / "gw.sqlite")
    req = RunRequest.model_validate(
        {
            "dataset": {"builtin": "arith", "size": 8},
            "sampling": {"n": 2},
            "schedule": {"steps": STEPS, "batch_size": 2, "staleness": 0},
            "trackers": [{"name": "tensorboard", "dir": "blocked/tb"}],
        }
    )
    run_id, _ = state.runs.create(owner="me", request=req)
    run_dir = tmp_path / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "blocked").write_text("a file where the tracker's folder should go")
    loop = RunLoop(run_id, state, Stages(), tmp_path)  # type: ignore[arg-type]
    status = asyncio.run(loop.run())
    assert loop.trackers.trackers == []  # it could not open
    return state, run_id, status


def test_tracker_specs_are_checked_at_submission(monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"dataset": {"builtin": "arith"}}
    with pytest.raises(ValidationError, match="trackers.0.name"):
        RunRequest.model_validate({**base, "trackers": [{"name": "comet"}]})
    with pytest.raises(ValidationError, match="each tracker at most once"):
        RunRequest.model_validate({**base, "trackers": [{"name": "mlflow"}, {"name": "mlflow"}]})
    with pytest.raises(ValidationError, match="operator setting"):
        RunRequest.model_validate({**base, "trackers": [{"name": "mlflow", "tracking_uri": "http://x:5000"}]})
    with pytest.raises(ValidationError, match="relative folder"):
        RunRequest.model_validate({**base, "trackers": [{"name": "wandb", "dir": "/etc"}]})
    # a library that is not installed: named in the error, before anything runs
    monkeypatch.setitem(models.TRACKER_LIBRARIES, "wandb", "loom_test_no_such_module")
    with pytest.raises(ValidationError, match="tracker 'wandb' is not installed"):
        RunRequest.model_validate({**base, "trackers": [{"name": "wandb"}]})


def test_uninstalled_tracker_is_a_422_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
    from fastapi.testclient import TestClient
    from helpers import API_KEYS, RUNS_KEY, auth

    from gateway.api import build_app
    from gateway.config import GatewaySettings
    from loom.queue import make_celery

    settings = Settings(
        data_dir=tmp_path,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
    )
    monkeypatch.setitem(models.TRACKER_LIBRARIES, "mlflow", "loom_test_no_such_module")
    celery_app = make_celery("gateway", settings)
    with TestClient(
        build_app(settings, celery_app=celery_app, config=GatewaySettings(run_loop=False))
    ) as client:
        body = {"dataset": {"builtin": "arith"}, "trackers": [{"name": "tensorboard"}, {"name": "mlflow"}]}
        r = client.post("/v1/runs", json=body, headers=auth(RUNS_KEY))
    assert r.status_code == 422, r.text
    assert "tracker 'mlflow' is not installed" in r.text and "loom-rl[mlflow]" in r.text
    assert client.app.state.gateway_state.runs.with_status("queued", "running") == []  # type: ignore[attr-defined]


def test_the_setting_names_the_default_trackers_and_the_operators_uri() -> None:
    assert [t.name for t in parse_setting("tensorboard, wandb")] == ["tensorboard", "wandb"]
    setting = '[{"name": "mlflow", "tracking_uri": "http://mlflow.internal:5000", "project": "p"}]'
    assert resolve(None, setting)[0].tracking_uri == "http://mlflow.internal:5000"
    mine = resolve([TrackerSpec(name="mlflow", project="mine")], setting)
    assert (mine[0].project, mine[0].tracking_uri) == ("mine", "http://mlflow.internal:5000")
    assert resolve([], "tensorboard") == []  # a run's empty list: no trackers
    assert Settings(trackers="mlflow,tensorboard").trackers == "mlflow,tensorboard"
    with pytest.raises(ValidationError, match="unknown tracker 'comet'"):
        Settings(trackers="tensorboard,comet")


def test_step_metrics_carry_every_reward_component_and_status() -> None:
    trajs = [
        Trajectory(id=f"t{i}", group_id="g", completion_ids=[1] * (i + 1), text=f"r{i}") for i in range(3)
    ]
    trajs[2].finish_reason = "length"
    rewards = [
        TrajectoryReward(trajectory_id="t0", total=1.0, components={"accuracy": 1.0, "length": 0.0}),
        TrajectoryReward(trajectory_id="t1", total=0.5, components={"accuracy": 0.0, "length": 0.5}),
        TrajectoryReward(
            trajectory_id="t2", total=0.0, components={"accuracy": 0.0, "length": 0.0}, status="timeout"
        ),
    ]
    scored = (Group(id="g", prompt="p", trajectories=trajs), RewardResult(group_id="g", rewards=rewards))
    m = step_metrics([scored, None], [scored], gen_seconds=2.0)
    assert m["reward/accuracy"] == pytest.approx(1 / 3) and m["reward/length"] == pytest.approx(1 / 6)
    assert m["status/ok"] == pytest.approx(2 / 3) and m["status/timeout"] == pytest.approx(1 / 3)
    assert m["truncated_ratio"] == pytest.approx(1 / 3)
    assert (m["advantage_max"], m["advantage_min"]) == (pytest.approx(0.5), pytest.approx(-0.5))
    samples = step_samples([None, scored], per_step=4)
    assert (
        len(samples) == 1 and samples[0]["response"] == "r0" and samples[0]["components"]["accuracy"] == 1.0
    )


def test_a_run_stores_a_few_scored_groups_per_step(tmp_path: Path) -> None:
    state, run_id, status = _run(tmp_path, [])
    assert status == "succeeded"
    rows = state.runs.samples(run_id)
    assert [(r["step"], r["idx"]) for r in rows] == [(s, i) for s in range(STEPS) for i in range(2)]
    one = state.runs.samples(run_id, step=1)
    assert [r["group_id"] for r in one] == [r["group"]["id"] for r in one]
    assert Group.model_validate(one[0]["group"]).trajectories[0].text == "answer 0"
    assert RewardResult.model_validate(one[0]["rewards"]).rewards[1].status == "no_answer"
    assert not (tmp_path / "runs" / run_id / "trackers").exists()  # trackers: [] writes nothing


def test_a_resumed_run_logs_on_into_the_same_tracker_runs(tmp_path: Path) -> None:
    """A restarted gateway reopens the run's trackers: one MLflow run, one TensorBoard folder."""
    specs = parse_setting("tensorboard,mlflow")
    for step in (0, 1):  # two gateway lives, one step each
        trackers = Trackers.open(specs, "run-resumed", tmp_path)
        assert [t.name for t in trackers.trackers] == ["tensorboard", "mlflow"]
        trackers.log(step, {"step": step, "reward_mean": 0.25 * (step + 1)}, [])
        trackers.close("interrupted" if step == 0 else "succeeded")
        assert trackers.failures == {"tensorboard": 0, "mlflow": 0}
    expected = {"reward_mean": [(0, 0.25), (1, 0.5)]}
    assert (
        mlflow_series((tmp_path / "trackers" / "mlflow").as_uri(), "run-resumed", ["reward_mean"]) == expected
    )
    assert tensorboard_scalars(tmp_path / "trackers" / "tensorboard") == expected


def test_a_run_that_names_no_trackers_gets_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loom.contracts.settings import get_settings

    monkeypatch.setenv("LOOM_TRACKERS", "tensorboard")
    get_settings.cache_clear()
    try:
        state, run_id, status = _run(tmp_path, None)
    finally:
        monkeypatch.delenv("LOOM_TRACKERS")
        get_settings.cache_clear()
    assert status == "succeeded"
    tb = tensorboard_scalars(tmp_path / "runs" / run_id / "trackers" / "tensorboard")
    assert tb["reward_mean"] == [
        (m["step"], pytest.approx(m["reward_mean"])) for m in state.runs.steps(run_id)
    ]
    assert not (tmp_path / "runs" / run_id / "trackers" / "mlflow").exists()
