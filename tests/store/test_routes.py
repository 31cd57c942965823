"""loom.store.routes' read routes: the learner's versions under /v1/store and a trainer's under
/v1/store/ns/{namespace} are the same three routes, each reading only its own namespace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from loom.contracts.settings import Settings
from loom.store import PolicyStore
from loom.store.routes import add_store_routes


def weights(fill: int) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        (d / "model.safetensors").write_bytes(bytes([fill]) * 1000)

    return write


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    settings = Settings(data_dir=tmp_path)
    store = PolicyStore(settings.policy_store_path)
    store.publish(1, weights(1))
    store.namespace("alice").publish(3, weights(3))
    app = FastAPI()
    app.state.settings = settings
    add_store_routes(app, Depends(lambda: None))
    return TestClient(app)


def test_learner_and_trainer_versions_are_read_apart(client: TestClient) -> None:
    assert client.get("/v1/store/latest").json() == {"version": 1}
    assert client.get("/v1/store/ns/alice/latest").json() == {"version": 3}
    assert client.get("/v1/store/ns/alice/v/1/manifest").status_code == 404
    assert client.get("/v1/store/v/3/manifest").status_code == 404
    manifest = client.get("/v1/store/ns/alice/v/3/manifest").json()
    assert [f["path"] for f in manifest["files"]] == ["model.safetensors"]
    assert client.get("/v1/store/ns/alice/v/3/files/model.safetensors").content == bytes([3]) * 1000
    assert client.get("/v1/store/v/1/files/model.safetensors").content == bytes([1]) * 1000


def test_unknown_or_malformed_namespace_is_not_found(client: TestClient) -> None:
    assert client.get("/v1/store/ns/bob/latest").status_code == 404
    assert client.get("/v1/store/ns/Bad..ns/v/3/manifest").status_code == 404
    assert client.get("/v1/store/ns/alice/v/three/manifest").status_code == 422
