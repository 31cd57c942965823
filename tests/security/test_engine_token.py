"""The rollout service's ``/engine`` mount (issue 35, finding 4): ``POST /engine/reset_prefix_cache``
changes the engine's state and ``GET /engine/server_info`` shows the model's path, so with
``LOOM_SERVICE_TOKEN`` set both need it (on vLLM both exist only in its dev mode); the generation
routes stay as open as a vLLM server's, so the real clients keep working: the ``openai`` client with
any key, TRL's ``VLLMClient`` as it is, and TRL's reset and configuration read with the token set on
its session. The rollout app runs in-process on the real torch engine (tiny model), served by uvicorn
for the clients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi.testclient import TestClient

from loom.contracts.settings import Settings
from rollout_svc.engines import set_engine
from tests.conftest import free_port

TOKEN = "engine-token-51c0d2"
GUARDED = (("POST", "/engine/reset_prefix_cache"), ("GET", "/engine/server_info"))
OPEN = (("GET", "/engine/health"), ("GET", "/engine/v1/models"), ("GET", "/engine/get_world_size"))


@pytest.fixture(scope="module")
def rollout_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from rollout_svc.api import app
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR

    set_engine(TorchEngine(CHECKPOINT_DIR, cache_entries=4))
    saved = app.state.settings
    app.state.settings = Settings(data_dir=tmp_path_factory.mktemp("rollout"), service_token=TOKEN)
    try:
        yield app
    finally:
        app.state.settings = saved
        set_engine(None)


@pytest.fixture(scope="module")
def engine_url(rollout_app: Any) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(rollout_app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/engine"
    finally:
        server.should_exit = True
        thread.join(10)


def test_state_and_configuration_routes_need_the_token_generation_does_not(rollout_app: Any) -> None:
    client = TestClient(rollout_app, raise_server_exceptions=False)
    for method, path in GUARDED:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.request(method, path, headers=headers)
            assert r.status_code == 401 and r.json()["error"] == "unauthenticated", (path, r.text)
        r = client.request(method, path, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, (path, r.text)
        assert "401" in rollout_app.openapi()["paths"][path][method.lower()]["responses"]
    # the model's path (the tiny checkpoint's directory here) only with the token
    assert "checkpoint" not in client.get("/engine/server_info", params={"config_format": "json"}).text
    shown = client.get(
        "/engine/server_info", params={"config_format": "json"}, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert "checkpoint" in shown.json()["vllm_config"]["model_config"]["model"], shown.text
    for method, path in OPEN:
        assert client.request(method, path).status_code == 200, path
    r = client.post("/engine/v1/completions", json={"prompt": "[plain] Compute 1+1.\n", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None, r.text


def test_the_openai_client_generates_without_the_token(engine_url: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{engine_url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt="[plain] Compute 47+85.\n", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_trls_client_generates_as_is_and_resets_with_the_token_on_its_session(
    engine_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trl.generation import vllm_client as trl_vllm

    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *a, **k: True)  # the install check only
    client = trl_vllm.VLLMClient(base_url=engine_url, connection_timeout=60)
    try:
        out = client.generate(["[plain] Compute 47+85.\n"], n=2, max_tokens=4, logprobs=0)
        assert len(out["completion_ids"]) == 2
        with pytest.raises(Exception, match="401"):
            client.reset_prefix_cache()
        with pytest.raises(Exception, match="401"):
            client.get_server_info()
        client.session.headers["Authorization"] = f"Bearer {TOKEN}"
        client.reset_prefix_cache()  # raises unless 200
        assert client.get_server_info()["weight_transfer_config"] is None
    finally:
        client.session.close()
