"""Internal routes (issue 24): with LOOM_SERVICE_TOKEN set, the rollout service's /v1/policy and the
learner's routes need it; /v1/policy loads versions of the policy store only (0 is the base model) and
its errors say nothing about files elsewhere. In-process apps on the real torch engine (tiny model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loom.contracts.settings import Settings
from loom.store import PolicyStore
from rollout_svc.engines import set_engine
from rollout_svc.engines.torch import TorchEngine

TOKEN = "test-service-token-8c2e"


def _perturbed_tiny(path: Path) -> None:
    """A version that differs from the base model (its final norm halved)."""
    import torch

    from zoo.tiny import load_model

    model = load_model()
    with torch.no_grad():
        model.model.norm.weight.mul_(0.5)
    model.save_pretrained(str(path))


@pytest.fixture(scope="module")
def tiny_engine() -> TorchEngine:
    from zoo.tiny import CHECKPOINT_DIR

    return TorchEngine(CHECKPOINT_DIR, cache_entries=4)


@pytest.fixture
def rollout(tiny_engine: TorchEngine, tmp_path: Path) -> Iterator[tuple[TestClient, PolicyStore, Any]]:
    from rollout_svc.api import app

    store = PolicyStore(tmp_path / "policy")
    store.publish(1, _perturbed_tiny)
    set_engine(tiny_engine)
    saved = app.state.settings

    def use(**settings: Any) -> None:
        app.state.settings = Settings(data_dir=tmp_path / "data", policy_store=store.root, **settings)

    use(service_token=TOKEN)
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, store, use
    finally:
        app.state.settings = saved
        set_engine(None)
        tiny_engine.load_policy_sync(_base())


def _base() -> Any:
    from loom.contracts.wire import PolicyVersion
    from zoo.tiny import CHECKPOINT_DIR

    return PolicyVersion(version=0, path=str(CHECKPOINT_DIR))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_the_policy_route_needs_the_service_token_when_one_is_set(rollout: Any) -> None:
    client, _, use = rollout
    for headers in ({}, bearer("wrong"), bearer(TOKEN + "x"), {"Authorization": TOKEN}):
        r = client.post("/v1/policy", json={"version": 1}, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"] == "unauthenticated" and r.headers["www-authenticate"] == "Bearer"
    r = client.post("/v1/policy", json={"version": 1}, headers=bearer(TOKEN))
    assert r.status_code == 200 and r.json()["policy_version"] == 1
    r = client.post("/v1/rollouts", json={"prompt": "1+1", "sampling": {"max_tokens": 2}})
    assert r.status_code == 200  # the public route needs no service token
    use()  # no token configured: the route is open, as before
    assert client.post("/v1/policy", json={"version": 1}).status_code == 200


def test_the_policy_route_reveals_nothing_about_paths_outside_the_store(rollout: Any, tmp_path: Path) -> None:
    """Before: /etc/passwd answered 'not a valid JSON file', a missing path something else."""
    client, store, _ = rollout
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text("{}")
    answers = set()
    outside = ("/etc/passwd", "/etc", "/no/such/dir", str(tmp_path / "outside"), f"{store.root}/../outside")
    for path in outside:
        r = client.post("/v1/policy", json={"path": path}, headers=bearer(TOKEN))
        assert r.status_code == 422, (path, r.text)
        answers.add(r.text)
    assert len(answers) == 1 and "passwd" not in answers.pop()
    r = client.post("/v1/policy", json={"version": 9}, headers=bearer(TOKEN))
    assert r.status_code == 404 and str(store.root) not in r.text


def test_version_0_loads_the_base_model_back(rollout: Any) -> None:
    client, _, _ = rollout
    body = {"prompt": "Compute 12+30.", "sampling": {"n": 2, "max_tokens": 16, "seed": 7}}

    def sample(**at: Any) -> list[list[int]]:
        r = client.post("/v1/rollouts", json={**body, **at})
        assert r.status_code == 200, r.text
        return [t["completion_ids"] for t in r.json()["trajectories"]]

    base = sample()
    assert client.post("/v1/policy", json={"version": 1}, headers=bearer(TOKEN)).json()["policy_version"] == 1
    assert sample(policy_version=1, policy_match="exact") != base  # version 1 is another model
    assert sample() == base  # no version: the base model, whatever the replica holds (docs/security.md)
    assert sample(policy_version=1, policy_match="exact") != base
    r = client.post("/v1/policy", json={"version": 0}, headers=bearer(TOKEN))
    assert r.status_code == 200 and r.json()["policy_version"] == 0, r.text
    assert sample() == base


def test_the_learners_routes_need_the_service_token_when_one_is_set(tmp_path: Path) -> None:
    from learner.api import build_app
    from loom.queue import make_celery

    settings = Settings(data_dir=tmp_path / "d", service_token=TOKEN)
    app = build_app(settings, make_celery("learner", settings))
    attention = {"token_ids": [1, 2, 3], "steps": [[0, 1], [1, 9]]}  # bad spans: a 422 once admitted
    with TestClient(app, raise_server_exceptions=False) as client:
        for headers in ({}, bearer("wrong")):
            for path, body in (("/v1/train_step", {}), ("/v1/score/attention", attention)):
                r = client.post(path, json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"] == "unauthenticated", (path, r.text)
        for path, body in (("/v1/train_step", {}), ("/v1/score/attention", attention)):
            r = client.post(path, json=body, headers=bearer(TOKEN))
            assert r.status_code == 422, (path, r.text)  # admitted, then validated
        assert client.get("/healthz").status_code == 200  # probes stay open


def test_loom_up_gives_each_stack_a_service_token_unless_one_is_set(tmp_path: Path) -> None:
    from launch.stack import Stack

    one = Stack(Settings(data_dir=tmp_path / "a"), workers=0)
    two = Stack(Settings(data_dir=tmp_path / "b"), workers=0)
    assert len(one.env["LOOM_SERVICE_TOKEN"]) >= 32
    assert one.env["LOOM_SERVICE_TOKEN"] != two.env["LOOM_SERVICE_TOKEN"]
    mine = Stack(Settings(data_dir=tmp_path / "c", service_token="operator-chosen"), workers=0)
    assert mine.env["LOOM_SERVICE_TOKEN"] == "operator-chosen"
