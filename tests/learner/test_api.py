"""The learner API and Celery tasks through a real broker and a real `loom worker learner`."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from learner.api import build_app
from loom.contracts.settings import Settings
from loom.contracts.wire import TrainBatch
from loom.queue import make_celery
from loom.store import PolicyStore


def test_invalid_batch_is_422_before_any_queue(tmp_path, batch_parts):
    settings = Settings(data_dir=tmp_path / "d")
    app = build_app(settings, make_celery("learner", settings))
    groups, rewards = batch_parts()
    rewards[1].rewards.pop()
    body = TrainBatch(step=0, groups=groups, rewards=rewards).model_dump(mode="json")
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/train_step", json=body)
        assert r.status_code == 422 and "has no reward" in r.json()["detail"]
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
        body = {"token_ids": ids, "steps": steps, "delta": 2, "policy_version": 2}
        r = client.post("/v1/score/attention", json=body)
        assert r.status_code == 200, r.text
        scores = r.json()["scores"]
        assert len(scores) == 6 and scores[0] == scores[1] == 0.0 and max(scores) > 0
        assert r.json()["policy_version"] == 2
        r = client.post("/v1/score/attention", json=body | {"policy_version": 9})  # never another's
        assert r.status_code == 409 and r.json()["error"] == "attention_version_unavailable", r.text


def test_hostile_batches_are_422_and_a_timeout_is_504(tmp_path, batch_parts):
    from loom.contracts.wire import TreeNode

    settings = Settings(data_dir=tmp_path / "d")
    app = build_app(settings, make_celery("learner", settings))
    groups, rewards = batch_parts()
    with TestClient(app, raise_server_exceptions=False) as client:

        def post(batch: TrainBatch, **params: object):  # type: ignore[no-untyped-def]
            return client.post("/v1/train_step", json=batch.model_dump(mode="json"), params=params)

        g0 = groups[0]
        t0, t1 = g0.trajectories[0].id, g0.trajectories[1].id
        for tree in (
            [
                TreeNode(id="a", parent="b", trajectory_id=t0, start=0, end=2),
                TreeNode(id="b", parent="a", trajectory_id=t1, start=0, end=2),
            ],
            [TreeNode(id="a", parent="a", trajectory_id=t0, start=0, end=2)],
            [TreeNode(id="a", parent="zz", trajectory_id=t0, start=0, end=2)],
        ):  # a cycle hung the API (and grew its memory); an unknown parent was a 500
            tg = g0.model_copy(update={"tree": tree})
            r = post(TrainBatch(step=0, groups=[tg], rewards=rewards[:1], estimator="treerl"))
            assert r.status_code == 422 and ("cycle" in r.text or "unknown parent" in r.text), r.text
        for params in ({"eps": [1]}, {"names": [1]}, {"beta": {}}):
            b = TrainBatch(step=0, groups=groups, rewards=rewards, estimator="hrpo").model_dump(mode="json")
            r = client.post("/v1/train_step", json=b | {"estimator_params": params})
            assert r.status_code == 422 and "estimator_params" in r.text, (params, r.text)
        body = TrainBatch(step=0, groups=groups, rewards=rewards).model_dump(mode="json")
        body["groups"][0]["trajectories"][0]["prompt_ids"][0] = -5
        r = client.post("/v1/train_step", json=body)
        assert r.status_code == 422 and "prompt_ids" in r.text
        r = post(TrainBatch(step=0, groups=groups, rewards=rewards), timeout=-1)
        assert r.status_code == 422
        r = post(TrainBatch(step=0, groups=groups, rewards=rewards), timeout=0.5)  # no worker: it waits
        assert r.status_code == 504 and r.json()["error"] == "timeout"
        steps = [[i, i + 1] for i in range(4097)]
        r = client.post("/v1/score/attention", json={"token_ids": list(range(4098)), "steps": steps})
        assert r.status_code == 422


def test_token_ids_outside_the_vocabulary_are_a_value_error(model_dir, tmp_path, batch_parts):
    from learner.config import LearnerSettings
    from learner.train import Learner

    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    groups, rewards = batch_parts()
    groups[0].trajectories[0].completion_ids[0] = 10**6
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        learner.train_step(TrainBatch(step=0, groups=groups, rewards=rewards))
    # longer than the model's context (512 positions): refused before the model sees it (on CUDA an
    # out-of-range position or id is a device-side assert that ends the process's CUDA context)
    groups, rewards = batch_parts()
    t = groups[0].trajectories[0]
    groups[0].trajectories[0] = t.model_copy(
        update={"completion_ids": [1] * 509, "loss_mask": [1] * 509, "logprobs": None, "segments": []}
    )
    with pytest.raises(ValueError, match="longer than the model's context 512"):
        learner.train_step(TrainBatch(step=0, groups=groups, rewards=rewards))
    assert learner.version == 0


def test_estimator_params_an_estimator_does_not_read_are_refused(batch_parts):
    from pydantic import ValidationError

    groups, rewards = batch_parts()
    for estimator, params in (("grpo", {"epsilon": 1e-6}), ("hrpo", {"betta": 0.1}), ("grpo", {"std": True})):
        with pytest.raises(ValidationError, match="not read by estimator"):
            TrainBatch(step=0, groups=groups, rewards=rewards, estimator=estimator, estimator_params=params)
    ok = {"grpo": {"eps": 1e-6, "batch_size": 4, "target_groups": 2}, "hrpo": {"beta": 0.1, "w_fmt": 1.0}}
    for estimator, params in ok.items():
        TrainBatch(step=0, groups=groups, rewards=rewards, estimator=estimator, estimator_params=params)
    baseline = {"std": 1, "reward_key": "total"}
    TrainBatch(step=0, groups=groups, rewards=rewards, estimator="global_baseline", estimator_params=baseline)
