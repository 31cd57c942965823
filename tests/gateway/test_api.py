"""The public API's guards: hashed keys, 401 vs 403, rate limits, backpressure, job idempotency,
no route to the internal services. In-process app on a real embedded broker in tmp_path."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from httpx import Response

sys.path.insert(0, str(Path(__file__).parent))
from helpers import ADMIN_KEY, API_KEYS, JOBS_KEY, RUNS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from gateway.keys import KeyRing, hash_key, main, parse_keys  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402
from loom.store import PolicyStore  # noqa: E402


def make_client(tmp_path: Path, **config: object) -> TestClient:
    """A gateway on ``tmp_path``; ``config``: its GatewaySettings besides run_loop=False."""
    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS
    )
    gateway = GatewaySettings(**{"run_loop": False, **config})  # type: ignore[arg-type]
    return TestClient(build_app(settings, celery_app=make_celery("gateway", settings), config=gateway))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(tmp_path) as c:
        yield c


JOB = {"job_key": "batch-1", "prompts": ["Compute 2+2."], "sampling": {"n": 2}}


def test_keys_are_stored_as_hashes_and_checked_in_constant_time() -> None:
    ring = KeyRing.from_spec(API_KEYS)
    assert JOBS_KEY not in API_KEYS and hash_key(JOBS_KEY) in API_KEYS
    found = ring.verify(JOBS_KEY)
    assert found is not None and found.name == "trainer" and found.scopes == {"jobs"}
    assert ring.verify(hash_key(JOBS_KEY)) is None  # the stored hash is not a key
    assert ring.verify("loom_wrong") is None
    with pytest.raises(ValueError):
        parse_keys("bad:1234")


def test_a_key_cannot_be_named_like_a_runs_lineage() -> None:
    """Runs train in namespaces named ``run-<id>`` (docs/security.md): no key may publish there."""
    with pytest.raises(ValueError, match="run-"):
        parse_keys(f"run-0123456789abcdef:{'0' * 64}")


def test_keys_cli_prints_a_key_once_and_its_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["new", "alice"]) == 0
    out = capsys.readouterr().out.splitlines()
    key = out[0].split(": ", 1)[1]
    entry = out[1].removeprefix("LOOM_API_KEYS=")
    assert KeyRing.from_spec(entry).verify(key) is not None and key not in entry


def test_a_key_carries_its_fair_share_weight(capsys: pytest.CaptureFixture[str]) -> None:
    """``name:sha256:scopes:weight`` (gateway/scheduler.py); default 1.0; a weight that is not a
    finite number > 0 is refused naming the key; the CLI writes the field."""
    digest = "0" * 64
    ring = KeyRing.from_spec(f"a:{digest},b:{'1' * 64}:jobs:2.5")
    assert ring.weights() == {"a": 1.0, "b": 2.5} and ring.keys[1].scopes == {"jobs"}
    for bad in ("0", "-1", "nan", "inf", "heavy"):
        with pytest.raises(ValueError, match="'c'.*weight"):
            parse_keys(f"c:{digest}:jobs:{bad}")
    assert main(["new", "bob", "--weight", "3"]) == 0
    entry = capsys.readouterr().out.splitlines()[1].removeprefix("LOOM_API_KEYS=")
    assert entry.endswith(":jobs+runs:3") and KeyRing.from_spec(entry).weights() == {"bob": 3.0}
    with pytest.raises(SystemExit):
        main(["new", "bob", "--weight", "0"])


def test_probes_are_open_everything_else_needs_a_key(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    for path in ("/metrics", "/version", "/openapi.json", "/v1/jobs/x", "/v1/runs/x", "/nowhere"):
        r = client.get(path)
        assert r.status_code == 401, path
        assert r.headers["WWW-Authenticate"] == "Bearer"
    assert client.post("/v1/jobs", json=JOB).status_code == 401
    assert client.post("/v1/jobs", json=JOB, headers=auth("loom_wrong")).status_code == 401
    assert client.get("/version", headers={"X-API-Key": JOBS_KEY}).status_code == 200


def test_a_valid_key_without_the_scope_is_forbidden(client: TestClient) -> None:
    assert client.get("/metrics", headers=auth(JOBS_KEY)).status_code == 403
    assert client.get("/v1/runs/run-x", headers=auth(JOBS_KEY)).status_code == 403
    assert client.post("/v1/jobs", json=JOB, headers=auth(RUNS_KEY)).status_code == 201  # jobs+runs
    r = client.get("/metrics", headers=auth(ADMIN_KEY))
    assert r.status_code == 200 and "loom_http_requests_total" in r.text


def test_internal_services_are_not_reachable_through_the_gateway(client: TestClient) -> None:
    for method, path in [
        ("POST", "/v1/rewards"),
        ("POST", "/v1/generate"),
        ("POST", "/v1/train_step"),
        ("POST", "/v1/policy/load"),
        ("GET", "/rollout/healthz"),
        ("GET", "/v1/proxy/reward/healthz"),
    ]:
        assert client.request(method, path, headers=auth(ADMIN_KEY), json={}).status_code == 404, path
    paths = {getattr(r, "path", "") for r in client.app.routes}  # type: ignore[attr-defined]
    assert not any("{path" in p for p in paths)  # no catch-all route


def test_job_submission_is_idempotent_by_job_key(client: TestClient) -> None:
    first = client.post("/v1/jobs", json=JOB, headers=auth(JOBS_KEY))
    again = client.post("/v1/jobs", json=JOB, headers=auth(JOBS_KEY))
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"] and again.json()["created"] is False
    changed = client.post("/v1/jobs", json={**JOB, "prompts": ["other"]}, headers=auth(JOBS_KEY))
    assert changed.status_code == 409
    other_owner = client.post("/v1/jobs", json=JOB, headers=auth(RUNS_KEY))  # keys are per API key
    assert other_owner.json()["id"] != first.json()["id"]
    view = client.get(f"/v1/jobs/{first.json()['id']}", headers=auth(JOBS_KEY)).json()
    assert view["status"] == "queued" and view["n_prompts"] == 1
    assert client.get(f"/v1/jobs/{first.json()['id']}", headers=auth(RUNS_KEY)).status_code == 404


def test_run_submission_is_idempotent_by_run_key_and_a_changed_request_names_the_run(
    client: TestClient,
) -> None:
    run = {"run_key": "r1", "dataset": {"builtin": "arith", "size": 8}, "schedule": {"steps": 2}}
    first = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
    again = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
    assert first.status_code == 201 and again.status_code == 200, first.text
    run_id = first.json()["id"]
    assert again.json() == {"id": run_id, "created": False}
    changed = client.post("/v1/runs", json={**run, "schedule": {"steps": 3}}, headers=auth(RUNS_KEY))
    assert changed.status_code == 409 and changed.json()["error"] == "conflict"
    assert run_id in changed.json()["detail"] and "run_key" in changed.json()["detail"]
    view = client.get(f"/v1/runs/{run_id}", headers=auth(RUNS_KEY)).json()
    assert (view["status"], view["total_steps"], view["batch_size"], view["completed_steps"]) == (
        "queued",
        2,
        8,
        0,
    )
    unkeyed = {k: v for k, v in run.items() if k != "run_key"}
    ids = {client.post("/v1/runs", json=unkeyed, headers=auth(RUNS_KEY)).json()["id"] for _ in range(2)}
    assert len(ids) == 2  # without a run_key every submission is a new run


def test_bad_job_body_is_422_with_field_path(client: TestClient) -> None:
    r = client.post(
        "/v1/jobs", json={"job_key": "k", "prompts": ["p"], "sampling": {"n": 0}}, headers=auth(JOBS_KEY)
    )
    assert r.status_code == 422
    assert ["body", "sampling", "n"] in [e["loc"] for e in r.json()["detail"]]
    bad = {"job_key": "k", "prompts": ["p"], "adaptive": {"n": 8, "samples_per_round": 2, "max_rounds": 3}}
    r = client.post("/v1/jobs", json=bad, headers=auth(JOBS_KEY))
    assert r.status_code == 422 and ["body", "adaptive"] in [e["loc"] for e in r.json()["detail"]]
    r = client.post(
        "/v1/jobs",
        content='{"job_key": "k", "prompts": ["p"], "sampling": {"temperature": NaN}}',
        headers={**auth(JOBS_KEY), "content-type": "application/json"},
    )
    assert r.status_code == 422
    assert ["body", "sampling", "temperature"] in [e["loc"] for e in r.json()["detail"]]


def test_a_jobs_reflection_params_are_stored_as_sent_and_bad_ones_are_422(client: TestClient) -> None:
    params = {"detector": "fixed", "fixed_keep": 0.5, "max_tokens": 32}
    r = client.post("/v1/jobs", json={**JOB, "reflect": params}, headers=auth(JOBS_KEY))
    assert r.status_code == 201, r.text
    stored = client.app.state.gateway_state.jobs.get(r.json()["id"])  # type: ignore[attr-defined]
    assert stored is not None and stored.request["reflect"]["fixed_keep"] == 0.5
    bad = {**JOB, "job_key": "batch-bad", "reflect": {"detector": "fixed", "fixed_keep": 2.0}}
    r = client.post("/v1/jobs", json=bad, headers=auth(JOBS_KEY))
    assert r.status_code == 422
    assert any(e["loc"][:2] == ["body", "reflect"] and "fixed_keep" in e["loc"] for e in r.json()["detail"])
    # the boolean of the first API still means REA-RL's defaults
    r = client.post(
        "/v1/jobs", json={**JOB, "job_key": "batch-true", "reflect": True}, headers=auth(JOBS_KEY)
    )
    assert r.status_code == 201


def test_rate_limit_is_429_with_retry_after_per_key(tmp_path: Path) -> None:
    # a token per 1000 s: no refill between the requests, however slowly a loaded machine sends them
    with make_client(tmp_path, rate=0.001, burst=3) as c:
        codes = [c.get("/version", headers=auth(JOBS_KEY)).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        r = c.get("/version", headers=auth(JOBS_KEY))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert c.get("/version", headers=auth(RUNS_KEY)).status_code == 200  # another key's bucket


def test_deep_queues_are_429_with_retry_after(tmp_path: Path) -> None:
    with make_client(tmp_path, max_queue_depth=0) as c:
        assert c.post("/v1/jobs", json=JOB, headers=auth(JOBS_KEY)).status_code == 201
        settings = c.app.state.settings  # type: ignore[attr-defined]
        make_celery("gateway", settings).send_task("rollout.ping")  # no worker: it waits in the queue
        import time

        time.sleep(1.1)  # the depth is cached for 1 s
        r = c.post("/v1/jobs", json={**JOB, "job_key": "batch-2"}, headers=auth(JOBS_KEY))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"] == "backpressure" and r.json()["queue_depth"] >= 1
        depths = c.get("/v1/queues", headers=auth(ADMIN_KEY)).json()
        assert any(k.endswith("rollout") and v >= 1 for k, v in depths.items())


def test_run_with_bad_dataset_is_422(client: TestClient) -> None:
    body = {"dataset": {"jsonl": '{"question": "x"}\n'}}
    r = client.post("/v1/runs", json=body, headers=auth(RUNS_KEY))
    assert r.status_code == 422 and r.json()["error"] == "invalid_dataset"


def _locs(r) -> list[list[object]]:  # type: ignore[no-untyped-def]
    return [e["loc"] for e in r.json()["detail"]]


def test_work_that_would_fail_in_every_worker_is_422_at_submission(client: TestClient) -> None:
    """Checked as the rollout and reward services will check it, before anything is queued."""
    job = {"job_key": "k", "prompts": ["p"]}
    cases = [
        ({**job, "prompts": [""]}, ["body", "prompts", 0]),
        ({**job, "prompts": ["x" * 100_001]}, ["body", "prompts", 0]),
        ({**job, "mode_params": {"foo": 1}}, ["body", "mode_params"]),
        ({**job, "mode": "tree", "mode_params": {"initial": 0}}, ["body", "mode_params"]),
        (
            {**job, "mode": "streaming", "mode_params": {"sentences": ["a."], "reading_wpm": 0}},
            ["body", "mode_params"],
        ),
        ({**job, "mode": "agent", "mode_params": {"tools": ["shell"]}}, ["body", "mode_params"]),
        ({**job, "mode": "agent", "mode_params": {"environment": "nosuch"}}, ["body", "mode_params"]),
        ({**job, "mode": "agent", "mode_params": {"env_options": {"a": 1}}}, ["body", "mode_params"]),
        ({**job, "mode": "agent_tree", "mode_params": {"strategy": "x"}}, ["body", "mode_params"]),
        ({**job, "mode": "agent_tree", "mode_params": {"environment": "e"}}, ["body", "mode_params"]),
        (
            {"job_key": "k", "tasks": [{"prompt": "p"}, {"prompt": "q", "mode_params": {"x": 1}}]},
            ["body", "tasks", 1, "mode_params"],
        ),
        (
            {**job, "reward": {"components": [{"name": "nosuch"}]}},
            ["body", "reward", "components", 0, "name"],
        ),
        ({**job, "policy_version": 10**20}, ["body", "policy_version"]),
    ]
    for body, loc in cases:
        r = client.post("/v1/jobs", json=body, headers=auth(JOBS_KEY))
        assert r.status_code == 422 and loc in _locs(r), (body, r.text)
    run = {"dataset": {"builtin": "arith", "size": 4}}
    cases = [
        ({"dataset": {"builtin": "arith", "size": 4, "knobs": {"nosuch": 1}}}, ["body", "dataset"]),
        ({"dataset": {"builtin": "countdown", "knobs": {"max_number": 10**8}}}, ["body", "dataset"]),
        ({**run, "initial_policy_version": 10**20}, ["body", "initial_policy_version"]),
        ({**run, "schedule": {"min_batch": 9, "max_batch": 2}}, ["body", "schedule"]),
        ({**run, "mode": "spawn", "mode_params": {"child_template": "{x}"}}, ["body", "mode_params"]),
        ({**run, "loss": {"lr": 1e300}}, ["body", "loss", "lr"]),
        ({**run, "estimator": "hrpo", "estimator_params": {"betta": 0.1}}, ["body", "estimator_params"]),
        ({**run, "filter_groups": "length"}, ["body", "filter_groups"]),  # not one of the run's components
        ({**run, "filter_max_batches": 4}, ["body", "filter_max_batches"]),  # no filter to refill for
        ({**run, "filter_groups": "accuracy", "filter_max_batches": 17}, ["body", "filter_max_batches"]),
    ]
    for body, loc in cases:
        r = client.post("/v1/runs", json=body, headers=auth(RUNS_KEY))
        assert r.status_code == 422 and loc in _locs(r), (body, r.text)
    r = client.post(
        "/v1/runs", json={"dataset": {"jsonl": '{"prompt": "' + "x" * 100_001 + '"}'}}, headers=auth(RUNS_KEY)
    )
    assert r.status_code == 422 and "line 1" in r.json()["detail"]
    r = client.post(
        "/v1/runs", json={"dataset": {"builtin": "countdown", "size": 100_000}}, headers=auth(RUNS_KEY)
    )
    assert r.status_code == 422 and "distinct countdown problems" in r.json()["detail"]
    r = client.get("/v1/runs/x/metrics", params={"after": 10**20}, headers=auth(RUNS_KEY))
    assert r.status_code == 422 and ["query", "after"] in _locs(r)


def test_a_policy_version_no_replica_could_load_is_422_at_submission(tmp_path: Path) -> None:
    """A rollout replica loads the version asked for, or the newest stored one above it; version 0 is
    the base model. Before, a job naming version 3 on an empty store was accepted (201) and then failed
    in the rollout worker (a ModeError from ``rollout_svc.rollout.catch_up``)."""
    with make_client(tmp_path) as client:

        def submit(key: str, version: int) -> Response:
            body = {**JOB, "job_key": key, "policy_version": version}
            return client.post("/v1/jobs", json=body, headers=auth(JOBS_KEY))

        def run(version: int) -> Response:
            body = {"dataset": {"builtin": "arith", "size": 4}, "initial_policy_version": version}
            return client.post("/v1/runs", json=body, headers=auth(RUNS_KEY))

        r = submit("v3-empty", 3)
        assert r.status_code == 422 and ["body", "policy_version"] in _locs(r)
        assert r.json()["detail"][0]["type"] == "unknown_policy_version"
        assert "none is" in r.json()["detail"][0]["msg"]
        assert not (tmp_path / "policy").exists()  # the check only reads
        r = run(1)
        assert r.status_code == 422 and ["body", "initial_policy_version"] in _locs(r)
        assert submit("v0", 0).status_code == 201 and run(0).status_code == 201

        store = PolicyStore(tmp_path / "policy")  # the gateway's LOOM_POLICY_STORE default
        for version in (1, 2):
            store.publish(version, lambda d: (d / "weights").write_text("w"))
        assert submit("v2", 2).status_code == 201
        assert submit("v1", 1).status_code == 201  # a replica may serve 2 for it
        r = submit("v3", 3)
        assert r.status_code == 422 and "the newest is 2" in r.json()["detail"][0]["msg"]
        assert run(2).status_code == 201 and run(3).status_code == 422
        # a run's base in another key's namespace is answered as a missing version
        store.namespace("someone").publish(2, lambda d: (d / "weights").write_text("w"))
        body = {"dataset": {"builtin": "arith", "size": 4}, "initial_policy_version": 2}
        r = client.post("/v1/runs", json={**body, "policy_namespace": "someone"}, headers=auth(RUNS_KEY))
        assert r.status_code == 422 and r.json()["detail"][0]["type"] == "unknown_policy_version"
        store.namespace("runner").publish(2, lambda d: (d / "weights").write_text("w"))  # RUNS_KEY's own
        r = client.post("/v1/runs", json={**body, "policy_namespace": "runner"}, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text
        # a job may name the lineage of one of its key's own runs, never another key's run
        lineage = r.json()["id"]
        store.namespace(lineage).publish(3, lambda d: (d / "weights").write_text("w"))
        job = {"prompts": ["1+1"], "policy_version": 3, "policy_namespace": lineage}
        own = client.post("/v1/jobs", json={**job, "job_key": "own-run"}, headers=auth(RUNS_KEY))
        assert own.status_code == 201, own.text
        other = client.post("/v1/jobs", json={**job, "job_key": "their-run"}, headers=auth(JOBS_KEY))
        assert other.status_code == 422 and other.json()["detail"][0]["type"] == "unknown_policy_version"
