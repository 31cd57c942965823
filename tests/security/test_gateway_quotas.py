"""Per-key quotas checked at submission (issue 24, item 5): the issue's hostile sizes are refused with
a 422 naming the quota, work that fits alone but not beside the key's other work is a 429 with
Retry-After, and concurrent jobs, runs and open event streams are capped per key. Before, all of it
was accepted (a job of 4096 prompts x n=1024 x 131072 tokens, a run of 1e6 steps x 4096 x 1024,
unlimited jobs and streams). In-process gateway on the embedded broker; nothing is run (the run loop
is off), so submitted work stays queued and holds its quota."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, JOBS_KEY, RUNS_KEY, auth, free_port  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402


def make_client(tmp_path: Path, **config: object) -> TestClient:
    """A gateway on ``tmp_path``; ``config``: its GatewaySettings besides run_loop=False."""
    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS
    )
    gateway = GatewaySettings(**{"run_loop": False, **config})  # type: ignore[arg-type]
    return TestClient(build_app(settings, celery_app=make_celery("gateway", settings), config=gateway))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(tmp_path) as c:  # the default quotas
        yield c


def _job(key: str, prompts: int = 1, **extra: object) -> dict[str, object]:
    return {"job_key": key, "prompts": [f"Compute {i}+1." for i in range(prompts)], **extra}


def test_the_issues_hostile_job_and_run_are_422_naming_the_quota(client: TestClient) -> None:
    hostile = _job("huge", 4096, sampling={"n": 1024, "max_tokens": 131072})
    r = client.post("/v1/jobs", json=hostile, headers=auth(JOBS_KEY))
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "quota_exceeded" and body["quota"] == "samples"
    assert body["requested"] == 4096 * 1024 and body["limit"] == 2**21
    assert "LOOM_GATEWAY_QUOTA_SAMPLES" in body["detail"]

    long_tokens = _job("long", 64, sampling={"n": 16, "max_tokens": 131072})  # 1024 samples, 134M tokens
    r = client.post("/v1/jobs", json=long_tokens, headers=auth(JOBS_KEY))
    assert r.status_code == 201, r.text  # generous for real work

    run = {
        "dataset": {"builtin": "arith", "size": 8},
        "sampling": {"n": 1024},
        "schedule": {"steps": 1_000_000, "batch_size": 4096, "max_batch": 4096},
    }
    r = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
    assert r.status_code == 422 and r.json()["error"] == "quota_exceeded", r.text
    assert r.json()["quota"] == "run_samples"
    # a long run of normal steps is only as big as its length allows
    run = {**run, "sampling": {"n": 8}, "schedule": {"steps": 1_000_000, "batch_size": 256}}
    r = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
    assert r.status_code == 422 and r.json()["quota"] == "run_samples"
    run["schedule"] = {"steps": 10_000, "batch_size": 256}
    assert client.post("/v1/runs", json=run, headers=auth(RUNS_KEY)).status_code == 201
    # a filtered step may draw 16 batches: 60,000 steps fit once (123M samples), not 16 times (1.97G)
    run = {**run, "run_key": "filtered", "schedule": {"steps": 60_000, "batch_size": 256}}
    run |= {"filter_groups": "accuracy", "filter_max_batches": 16}
    r = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
    assert r.status_code == 422 and r.json()["quota"] == "run_samples", r.text
    assert r.json()["requested"] == 60_000 * 256 * 8 * 16
    assert (
        client.post("/v1/runs", json={**run, "filter_max_batches": 1}, headers=auth(RUNS_KEY)).status_code
        == 201
    )


def test_work_beside_the_keys_other_work_is_429_until_some_ends(tmp_path: Path) -> None:
    with make_client(tmp_path, quota_jobs=2, quota_samples=100) as c:
        first = c.post("/v1/jobs", json=_job("a", 10, sampling={"n": 4}), headers=auth(JOBS_KEY))
        assert first.status_code == 201
        r = c.post("/v1/jobs", json=_job("b", 20, sampling={"n": 4}), headers=auth(JOBS_KEY))
        assert r.status_code == 429 and r.json()["quota"] == "samples", r.text  # 40 held + 80 > 100
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["in_use"] == 40
        assert (
            c.post("/v1/jobs", json=_job("c", 10, sampling={"n": 4}), headers=auth(JOBS_KEY)).status_code
            == 201
        )
        r = c.post("/v1/jobs", json=_job("d"), headers=auth(JOBS_KEY))
        assert r.status_code == 429 and r.json()["quota"] == "jobs"
        # another key has its own quotas
        assert c.post("/v1/jobs", json=_job("d"), headers=auth(RUNS_KEY)).status_code == 201
        # an idempotent resubmission is not new work
        again = c.post("/v1/jobs", json=_job("a", 10, sampling={"n": 4}), headers=auth(JOBS_KEY))
        assert again.status_code == 200 and again.json()["id"] == first.json()["id"]
        # cancelling frees the quota
        r = c.post(f"/v1/jobs/{first.json()['id']}/cancel", headers=auth(JOBS_KEY))
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        assert c.post("/v1/jobs", json=_job("d"), headers=auth(JOBS_KEY)).status_code == 201


def test_tree_and_spawn_jobs_are_charged_by_their_modes_budget(tmp_path: Path) -> None:
    """Before, a job held prompts x n samples whatever its mode: a tree job with n=1 held one sample
    and generated 172 trajectories. Now a tree job holds initial x (1 + iterations x branches x
    continuations) paths per prompt and a spawn job every child its parents may spawn."""
    tree = {"mode": "tree", "mode_params": {"initial": 4, "branches": 2, "continuations": 3}}
    with make_client(tmp_path, quota_samples=100) as c:
        big = _job("tree-big", 4, sampling={"n": 1, "max_tokens": 64}, **tree)  # 4 x 4 x (1 + 6) = 112
        r = c.post("/v1/jobs", json=big, headers=auth(JOBS_KEY))
        assert r.status_code == 422 and r.json()["quota"] == "samples", r.text
        assert r.json()["requested"] == 4 * 4 * (1 + 1 * 2 * 3)
        small = _job("tree", 2, sampling={"n": 1, "max_tokens": 64}, **tree)  # 56 paths
        assert c.post("/v1/jobs", json=small, headers=auth(JOBS_KEY)).status_code == 201
        again = _job("tree-2", 2, sampling={"n": 1, "max_tokens": 64}, **tree)
        r = c.post("/v1/jobs", json=again, headers=auth(JOBS_KEY))
        assert r.status_code == 429 and r.json()["in_use"] == 56, r.text  # held at its tree budget
        # spawn: 2 rollouts x (a parent + 8 children) = 18 calls; tokens: the parent's 64 + 8 x 32
        spawn = {"mode": "spawn", "mode_params": {"max_children": 8, "child_max_tokens": 32}}
        job = _job("spawn", 1, sampling={"n": 2, "max_tokens": 64}, **spawn)
        r = c.post("/v1/jobs", json=job, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text
        spawn_big = _job("spawn-big", 5, sampling={"n": 2, "max_tokens": 64}, **spawn)  # 90 + 18 > 100
        r = c.post("/v1/jobs", json=spawn_big, headers=auth(RUNS_KEY))
        assert r.status_code == 429 and r.json()["in_use"] == 18 and r.json()["requested"] == 90, r.text
    with make_client(tmp_path / "tokens", quota_tokens=1000) as c:
        job = _job("spawn-tokens", 2, sampling={"n": 2, "max_tokens": 64}, **spawn)  # 2 x 2 x 320
        r = c.post("/v1/jobs", json=job, headers=auth(JOBS_KEY))
        assert r.status_code == 422 and r.json()["quota"] == "tokens", r.text
        assert r.json()["requested"] == 2 * 2 * (64 + 8 * 32)


def test_concurrent_runs_are_capped_per_key(tmp_path: Path) -> None:
    with make_client(tmp_path, quota_runs=2) as c:
        run = {"dataset": {"builtin": "arith", "size": 8}, "schedule": {"steps": 2, "batch_size": 2}}
        codes = [
            c.post("/v1/runs", json={**run, "run_key": f"r{i}"}, headers=auth(RUNS_KEY)) for i in range(3)
        ]
        assert [r.status_code for r in codes] == [201, 201, 429]
        assert codes[2].json()["quota"] == "runs" and "LOOM_GATEWAY_QUOTA_RUNS" in codes[2].json()["detail"]
        c.post(f"/v1/runs/{codes[0].json()['id']}/cancel", headers=auth(RUNS_KEY))
        assert c.post("/v1/runs", json={**run, "run_key": "r3"}, headers=auth(RUNS_KEY)).status_code == 201


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """The gateway under a real uvicorn (event streams need a server that streams; TestClient buffers
    whole responses), with at most 2 open streams per key."""
    settings = Settings(
        data_dir=tmp_path,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
    )
    config = GatewaySettings(run_loop=False, quota_streams=2)
    app = build_app(settings, celery_app=make_celery("gateway", settings), config=config)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def test_open_event_streams_are_capped_per_key(server: str) -> None:
    with httpx.Client(base_url=server, timeout=30) as c:
        job_id = c.post("/v1/jobs", json=_job("s"), headers=auth(JOBS_KEY)).json()["id"]
        path = f"/v1/jobs/{job_id}/events"
        with (
            c.stream("GET", path, headers=auth(JOBS_KEY)) as one,
            c.stream("GET", path, headers=auth(JOBS_KEY)) as two,
        ):
            assert one.status_code == 200 and two.status_code == 200
            third = c.get(path, headers=auth(JOBS_KEY))
            assert third.status_code == 429 and third.json()["quota"] == "streams", third.text
            assert int(third.headers["Retry-After"]) >= 1
            other = c.post("/v1/jobs", json=_job("s"), headers=auth(RUNS_KEY)).json()["id"]
            with c.stream("GET", f"/v1/jobs/{other}/events", headers=auth(RUNS_KEY)) as theirs:
                assert theirs.status_code == 200  # another key's streams are its own
        # closed streams give their slots back (the server sees the disconnect within a poll)
        c.post(f"/v1/jobs/{job_id}/cancel", headers=auth(JOBS_KEY))
        deadline = time.monotonic() + 20
        ended = []
        while len(ended) < 3:
            r = c.get(path, headers=auth(JOBS_KEY))
            if r.status_code == 200:
                ended.append("event: end" in r.text)
            else:
                assert r.status_code == 429 and time.monotonic() < deadline, r.text
                time.sleep(0.1)
        assert all(ended)  # a finished stream also gave its slot back: 3 in a row with a cap of 2


def test_a_tree_run_is_charged_by_its_modes_budget(tmp_path: Path) -> None:
    """A run's charge reads the same mode budget as a job's: a tree run with n=1 holds (staleness +
    1) x batch x its tree's paths, not one sample per prompt, and its whole length counts every path
    of every step."""
    tree = {"mode": "tree", "mode_params": {"initial": 2, "branches": 2, "continuations": 2}}
    paths = 2 * (1 + 1 * 2 * 2)  # 10 per prompt
    run = {
        "dataset": {"builtin": "arith", "size": 8},
        "sampling": {"n": 1, "max_tokens": 32},
        "schedule": {"steps": 10, "batch_size": 4, "staleness": 1},
        **tree,
    }
    with make_client(tmp_path, quota_samples=100, max_run_samples=1000) as c:
        r = c.post("/v1/runs", json={**run, "run_key": "a"}, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text  # 2 x 4 x 10 = 80 held
        r = c.post("/v1/runs", json={**run, "run_key": "b"}, headers=auth(RUNS_KEY))
        assert r.status_code == 429 and r.json()["quota"] == "samples", r.text
        assert r.json()["in_use"] == 2 * 4 * paths and r.json()["requested"] == 2 * 4 * paths
        # its length: 10 steps x 4 prompts x 10 paths = 400 fits; 30 steps (1200) do not
        longer = {**run, "run_key": "c", "schedule": {**run["schedule"], "steps": 30}}  # type: ignore[dict-item]
        r = c.post("/v1/runs", json=longer, headers=auth(RUNS_KEY))
        assert r.status_code == 422 and r.json()["quota"] == "run_samples", r.text
        assert r.json()["requested"] == 30 * 4 * paths
