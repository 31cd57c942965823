"""The learner API and Celery tasks through a real broker and a real `loom worker learner`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from learner.api import build_app
from loom.queue import make_celery
from loom.schemas import TrainBatch
from loom.settings import Settings
from loom.store import PolicyStore


def test_invalid_batch_is_422_before_any_queue(tmp_path, batch_parts):
    settings = Settings(data_dir=tmp_path / "d")
    app = build_app(settings, make_celery("learner", settings))
    groups, rewards = batch_parts()
    rewards[1].rewards.pop()
    body = TrainBatch(step=0, groups=groups, rewards=rewards).model_dump(mode="json")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/train_step", json=body)
        assert r.status_code == 422 and "has no reward" in r.json()["detail"]["detail"]
        body["estimator"] = "nope"
        r = client.post("/v1/train_step", json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "estimator"
        r = client.post("/v1/score/attention", json={"token_ids": [1, 2, 3], "steps": [[0, 1], [1, 9]]})
        assert r.status_code == 422


@pytest.mark.slow
def test_train_step_and_attention_through_the_worker(broker_env, loom_worker, model_dir, batch_parts):
    store = broker_env.tmp / "policy"
    broker_env.extra_env.update(LOOM_MODEL=str(model_dir), LOOM_POLICY_STORE=str(store))
    loom_worker("learner", broker_env)
    app = build_app(broker_env.settings, broker_env.app("learner"))
    groups, rewards = batch_parts()
    with TestClient(app, raise_server_exceptions=False) as client:
        for step in (0, 1):
            body = TrainBatch(step=step, groups=groups, rewards=rewards, estimator="hrpo").model_dump(
                mode="json"
            )
            r = client.post("/v1/train_step", json=body, params={"timeout": 120})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["policy_version"] == step + 1 and out["policy"]["version"] == step + 1
        assert PolicyStore(store).versions() == [1, 2]
        ids = list(range(1, 31))
        steps = [[0, 5], [5, 10], [10, 15], [15, 20], [20, 25], [25, 30]]
        r = client.post("/v1/score/attention", json={"token_ids": ids, "steps": steps, "delta": 2})
        assert r.status_code == 200, r.text
        scores = r.json()["scores"]
        assert len(scores) == 6 and scores[0] == scores[1] == 0.0 and max(scores) > 0
        assert r.json()["policy_version"] == 2
