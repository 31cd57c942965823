"""``POST /v1/jobs/{id}/cancel`` stops a job's remaining work (issue 24, item 5): when it answers, the
job's status is ``cancelled`` and no more of its groups start generating or scoring (tasks already
queued are skipped by key: a worker that receives one returns at once). A real gateway process and a
real Celery worker running the SIMPLE STAGE TASKS (tests/gateway/stage_tasks.py) on both brokers; the
worker logs when each group's work starts. Before, there was no such route (404)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, JOBS_KEY, GatewayProcess, free_port, kill_group, start_stage_workers  # noqa: E402

from loom.queue import queue_depths  # noqa: E402

N_PROMPTS = 16


def _started(log: Path) -> list[tuple[float, str, str]]:
    if not log.exists():
        return []
    rows = [line.split() for line in log.read_text().splitlines() if line.strip()]
    return [(float(t), task, gid) for t, task, gid in rows]


def test_a_cancelled_job_starts_no_group_after_the_answer(broker_env: Any, tmp_path: Path) -> None:
    task_log = tmp_path / "tasks.log"
    broker_env.extra_env.update(
        LOOM_API_KEYS=API_KEYS, LOOM_TEST_TASK_LOG=str(task_log), LOOM_TEST_GEN_SECONDS="0.4"
    )
    env = broker_env.process_env()
    workers = start_stage_workers(env, broker_env.namespace, tmp_path, concurrency=1)
    gw = GatewayProcess(env, free_port(), tmp_path / "gateway.log")
    try:
        gw.start()
        body = {"job_key": "cancel-me", "prompts": [f"q{i}" for i in range(N_PROMPTS)], "sampling": {"n": 2}}
        r = gw.post("/v1/jobs", JOBS_KEY, body)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        deadline = time.monotonic() + 60
        while gw.get(f"/v1/jobs/{job_id}", JOBS_KEY).json()["n_done"] < 1:
            assert time.monotonic() < deadline, gw.log_path.read_text()[-3000:]
            time.sleep(0.05)

        r = gw.post(f"/v1/jobs/{job_id}/cancel", JOBS_KEY, None)
        answered = time.time()
        assert r.status_code == 200, r.text
        view = r.json()
        assert view["status"] == "cancelled" and 1 <= view["n_done"] < N_PROMPTS

        # the worker drains what was queued: every message consumed, none of it worked on
        app = broker_env.app("gateway")
        deadline = time.monotonic() + 30
        while (queue_depths(app).get("rollout") or 0) + (queue_depths(app).get("reward") or 0) > 0:
            assert time.monotonic() < deadline, "the cancelled job's queued tasks were never consumed"
            time.sleep(0.2)
        time.sleep(1.5)  # a task received just now would have started by now
        # At most the one task the worker (one slot) may have let through its key check just before the
        # skip was stored can start after the answer; every other queued task was skipped.
        late = [row for row in _started(task_log) if row[0] > answered]
        assert len(late) <= 1, f"work started after the cancel: {late}"
        generated = {gid for _, task, gid in _started(task_log) if task == "generate"}
        assert len(generated) < N_PROMPTS  # the rest was skipped, not merely finished before the cancel
        after = gw.get(f"/v1/jobs/{job_id}", JOBS_KEY).json()
        assert after["status"] == "cancelled" and after["n_done"] == view["n_done"]
        # cancelling again, or a job that has ended, changes nothing
        again = gw.post(f"/v1/jobs/{job_id}/cancel", JOBS_KEY, None).json()
        assert again["status"] == "cancelled" and again["n_done"] == view["n_done"]
    finally:
        gw.kill()
        for w in workers:
            kill_group(w)
