"""``POST /v1/ping`` is an operator's route (issue 35, finding 4): it occupies a worker for ``delay``
seconds and a thread of the API for ``timeout``, and four token-less ``{"delay": 15}`` pings pushed a
one-prompt job from 0.2 s to 31.1 s. With ``LOOM_SERVICE_TOKEN`` set (``loom up`` always sets one)
every private service's ping needs the token; the gateway's needs an admin API key, also when the
gateway has the token (as under ``loom up``). ``delay`` is bounded by ``PING_MAX_DELAY_S``.

In-process apps; the learner's ping goes through a real learner worker on an embedded broker, the
gateway's to its (empty) queues.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from loom.contracts.settings import SERVICES, Settings
from loom.service import PING_MAX_DELAY_S
from tests.conftest import BrokerEnv, start_worker

TOKEN = "ping-token-3b1f7e"
ADMIN_KEY = "loom_ping-admin"
JOBS_KEY = "loom_ping-jobs-only"


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _refused(r: Any) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"] == "unauthenticated" and r.headers["www-authenticate"] == "Bearer"


@pytest.fixture(params=["rollout_svc", "reward_svc", "reflect_svc"])
def module_app(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[FastAPI]:
    """``<package>.api:app`` as uvicorn imports it, with the service token set (no lifespan: nothing
    here reaches a worker)."""
    app: FastAPI = importlib.import_module(f"{request.param}.api").app
    saved = app.state.settings
    app.state.settings = Settings(data_dir=tmp_path, service_token=TOKEN)
    try:
        yield app
    finally:
        app.state.settings = saved


def test_a_private_services_ping_needs_the_token_before_anything_else(module_app: FastAPI) -> None:
    client = TestClient(module_app, raise_server_exceptions=False)
    for headers in ({}, bearer("wrong"), bearer(TOKEN + "x"), {"Authorization": TOKEN}):
        _refused(client.post("/v1/ping", json={"delay": 15}, headers=headers))
        _refused(client.post("/v1/ping", json={"delay": "x"}, headers=headers))  # the body is not read
    # with the token the request reaches the body's check: a delay above the bound is a 422 naming it
    r = client.post("/v1/ping", json={"delay": PING_MAX_DELAY_S + 1}, headers=bearer(TOKEN))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "delay"], r.text
    op = module_app.openapi()["paths"]["/v1/ping"]["post"]
    assert "401" in op["responses"]


def test_the_learners_ping_round_trips_with_the_token_only(tmp_path: Path) -> None:
    from learner.api import build_app
    from loom.queue import make_celery

    benv = BrokerEnv(
        kind="embedded",
        tmp=tmp_path,
        env={
            "LOOM_BROKER_URL": "embedded",
            "LOOM_RESULT_BACKEND": "embedded",
            "LOOM_DATA_DIR": str(tmp_path),
        },
    )
    settings = Settings(data_dir=tmp_path, service_token=TOKEN)
    celery_app = make_celery("learner", settings)
    worker = start_worker(benv, "learner", ready_timeout=180)
    try:
        client = TestClient(build_app(settings, celery_app=celery_app), raise_server_exceptions=False)
        _refused(client.post("/v1/ping", json={"delay": 1}))
        r = client.post("/v1/ping", json={"delay": 0.1, "timeout": 120}, headers=bearer(TOKEN))
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["ok"] is True
        assert answer["queues"]["learner"]["worker"]["pid"] in (worker.pid, *worker.children())
    finally:
        worker.kill_group()
        celery_app.close()


@pytest.fixture
def gateway(tmp_path: Path) -> TestClient:
    """The gateway as ``loom up`` configures it: API keys and the stack's service token."""
    from gateway.api import build_app
    from gateway.config import GatewaySettings

    keys = ",".join(
        f"{name}:{hashlib.sha256(key.encode()).hexdigest()}:{scopes}"
        for name, key, scopes in (("admin", ADMIN_KEY, "jobs+runs+admin"), ("jobs", JOBS_KEY, "jobs"))
    )
    settings = Settings(data_dir=tmp_path, api_keys=keys, service_token=TOKEN)
    config = GatewaySettings(run_loop=False, burst=1000)
    return TestClient(build_app(settings, config=config), raise_server_exceptions=False)


def test_the_gateways_ping_needs_an_admin_key(gateway: TestClient) -> None:
    r = gateway.post("/v1/ping", json={"delay": 15})
    assert r.status_code == 401 and r.json()["error"] == "unauthenticated", r.text
    r = gateway.post("/v1/ping", json={"delay": 15}, headers=bearer(TOKEN))  # not an API key here
    assert r.status_code == 401, r.text
    r = gateway.post("/v1/ping", json={"delay": 1}, headers=bearer(JOBS_KEY))
    assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
    r = gateway.post("/v1/ping", json={"delay": PING_MAX_DELAY_S + 1}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "delay"], r.text
    # the admin key passes the ping's token check too: no worker here, so every queue times out
    r = gateway.post("/v1/ping", json={"timeout": 0.5}, headers=bearer(ADMIN_KEY))
    assert r.status_code == 504, r.text
    assert r.json()["ok"] is False and set(r.json()["queues"]) == set(SERVICES)  # the sandbox's too
