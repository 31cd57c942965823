"""End to end over a real broker (embedded and RabbitMQ): a gateway process, real Celery workers
running the SIMPLE STAGE TASKS of stage_tasks.py under the real task names (not the real rollout,
reward and learner services), jobs with adaptive sampling, and a run whose gateway is killed -9
mid-run and restarted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers import API_KEYS, JOBS_KEY, REPO, RUNS_KEY, GatewayProcess, free_port, wait_until  # noqa: E402

HERE = Path(__file__).parent


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    try:
        kids = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        kids = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for k in kids:
        try:
            k.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=10)


@pytest.fixture
def stack(broker_env: Any, tmp_path: Path) -> Iterator[Callable[[], GatewayProcess]]:
    """Stage workers (rollout+reward with 2 processes, learner with 1) and a gateway factory."""
    stage_log = tmp_path / "stage.log"
    broker_env.extra_env.update(
        LOOM_API_KEYS=API_KEYS, LOOM_TEST_STAGE_LOG=str(stage_log), LOOM_TEST_TRAIN_SECONDS="0.4"
    )
    env = broker_env.process_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE)])
    ns = broker_env.namespace
    procs: list[subprocess.Popen[bytes]] = []
    gateways: list[GatewayProcess] = []
    try:
        logs = []
        for name, queues, conc in [("stages", f"{ns}rollout,{ns}reward", 2), ("learner", f"{ns}learner", 1)]:
            log_path = tmp_path / f"worker-{name}.log"
            argv = [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "stage_tasks",
                "worker",
                "-Q",
                queues,
                "-c",
                str(conc),
            ]
            argv += [
                "--pool",
                "prefork",
                "-l",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "-n",
                f"{name}@%h",
            ]
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        argv, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
            logs.append(log_path)
        deadline = time.monotonic() + 60
        while not all(" ready." in p.read_text(errors="replace") for p in logs):
            assert time.monotonic() < deadline, "\n".join(p.read_text()[-2000:] for p in logs)
            time.sleep(0.1)

        def gateway() -> GatewayProcess:
            gw = GatewayProcess(env, free_port(), tmp_path / "gateway.log")
            gateways.append(gw)
            return gw

        yield gateway
    finally:
        for gw in gateways:
            gw.kill()
        for p in procs:
            _kill_tree(p)


RUN = {
    "run_key": "resume-test",
    "dataset": {"jsonl": "".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(10))},
    "sampling": {"n": 4, "max_tokens": 8},
    "estimator": "grpo",
    "schedule": {"steps": 6, "batch_size": 3, "staleness": 1, "adaptive_batch": True, "target_groups": 3},
}


@pytest.mark.slow
def test_killed_gateway_resumes_run_from_last_completed_step(
    stack: Callable[[], GatewayProcess], tmp_path: Path
) -> None:
    gw = stack()
    gw.start()
    created = gw.post("/v1/runs", RUNS_KEY, RUN)
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    wait_until(lambda: gw.get(f"/v1/runs/{run_id}", RUNS_KEY).json()["completed_steps"] >= 2, 60, "2 steps")
    gw.kill()  # SIGKILL mid-run: step 2's generation and training are in flight
    trained_before_restart = (tmp_path / "stage.log").read_text().split("\n")

    gw.start()
    again = gw.post("/v1/runs", RUNS_KEY, RUN)  # idempotent by run_key
    assert again.status_code == 200 and again.json()["id"] == run_id
    view = wait_until(
        lambda: (
            (v := gw.get(f"/v1/runs/{run_id}", RUNS_KEY).json())["status"] in ("succeeded", "failed") and v
        ),
        90,
        "the run to finish",
    )
    assert view["status"] == "succeeded", view
    metrics = gw.get(f"/v1/runs/{run_id}/metrics", RUNS_KEY).json()
    assert [m["step"] for m in metrics] == list(range(6))
    assert [m["policy_version"] for m in metrics] == list(range(1, 7))
    assert all(m["staleness"] <= 1 for m in metrics) and metrics[-1]["staleness"] == 1  # overlapped
    assert all(0.0 <= m["zero_variance_ratio"] <= 1.0 and m["tokens_per_s"] > 0 for m in metrics)
    # every step trained exactly once by the learner worker, in order, across the restart
    lines = [ln.split() for ln in (tmp_path / "stage.log").read_text().splitlines()]
    assert [int(step) for step, _, _ in lines] == list(range(6))
    assert len([ln for ln in trained_before_restart if ln]) >= 2
    jsonl = Path(tmp_path / "loom-data" / "runs" / run_id / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in jsonl] == list(range(6))


@pytest.mark.slow
def test_job_with_adaptive_sampling_streams_scored_groups(stack: Callable[[], GatewayProcess]) -> None:
    gw = stack()
    gw.start()
    body = {
        "job_key": "adaptive-1",
        "tasks": [{"prompt": "q6", "label": "1"}, {"prompt": "impossible q", "label": "1"}, {"prompt": "q3"}],
        "sampling": {"n": 4, "max_tokens": 8},
        "adaptive": {"n": 4, "samples_per_round": 4, "max_rounds": 3, "exit": "balanced"},
    }
    job_id = gw.post("/v1/jobs", JOBS_KEY, body).json()["id"]
    events: list[tuple[str, Any]] = []
    with httpx.stream(
        "GET",
        f"{gw.url}/v1/jobs/{job_id}/events",
        headers={"Authorization": f"Bearer {JOBS_KEY}"},
        timeout=60,
    ) as r:
        assert r.status_code == 200
        kind = ""
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
    assert [k for k, _ in events] == ["group"] * 3 + ["end"] and events[-1][1]["status"] == "succeeded"
    view = gw.get(f"/v1/jobs/{job_id}", JOBS_KEY).json()
    by_index = {g["index"]: g for g in view["groups"]}
    assert by_index[1]["group"] is None  # never a positive: dropped
    dropped = sum(1 for g in view["groups"] if g["group"] is None)  # q3 (p=0.35) may rarely be too
    assert view["counters"]["adaptive_dropped"] == dropped
    # M=4 per round: kept prompts paid for the rounds they used, dropped ones for all R=3 rounds
    rounds = [g["group"]["pool"]["rounds"] for g in view["groups"] if g["group"]]
    assert view["counters"]["adaptive_samples"] == 4 * sum(rounds) + 4 * 3 * dropped
    for g in view["groups"]:
        if g["group"] is None:
            continue
        assert len(g["group"]["trajectories"]) == 4
        pool = g["group"]["pool"]
        assert pool["n_sampled"] == 4 * pool["rounds"]
        totals = [r["total"] for r in g["rewards"]["rewards"]]
        assert 0 < sum(totals) < 4  # kept groups carry both classes
