"""A job costs no thread while it waits (issue 24, item 5): 60 jobs of 4 prompts each wait on 240
queued rollout tasks (no worker consumes them) while the gateway's thread count stays a small constant.
Before, each waiting job held a thread plus one per prompt in flight (up to 9): 99 queued jobs held
910 threads. In-process gateway with its run loop on the embedded broker."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from fastapi.testclient import TestClient  # noqa: E402
from helpers import API_KEYS, JOBS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery, queue_depths  # noqa: E402

JOBS, PROMPTS = 60, 4
SPARE_THREADS = 16  # the work loop, the result hub, publishers, asyncio's pool: a constant, not per job


def test_sixty_waiting_jobs_hold_no_thread_each(tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
    )
    # 60 submissions at once: the per-key request rate is not under test; every group in the broker
    # (the fair scheduler's window holds them all: the broker's queue is what this test counts)
    config = GatewaySettings(quota_jobs=JOBS, burst=1000, rollout_window=JOBS * PROMPTS)
    celery_app = make_celery("gateway", settings)
    with TestClient(build_app(settings, celery_app=celery_app, config=config)) as c:
        before = threading.active_count()
        for j in range(JOBS):
            body = {"job_key": f"wait-{j}", "prompts": [f"q{j}.{i}" for i in range(PROMPTS)]}
            assert c.post("/v1/jobs", json=body, headers=auth(JOBS_KEY)).status_code == 201
        deadline = time.monotonic() + 120
        while (queue_depths(celery_app).get("rollout") or 0) < JOBS * PROMPTS:  # all of them waiting
            assert time.monotonic() < deadline, queue_depths(celery_app)
            time.sleep(0.2)
        waiting = threading.active_count()
        names = sorted({t.name.rstrip("0123456789_-") for t in threading.enumerate()})
        assert waiting - before <= SPARE_THREADS, (before, waiting, names)
        jobs = c.app.state.gateway_state.jobs.with_status("running")  # type: ignore[attr-defined]
        assert len(jobs) == JOBS
