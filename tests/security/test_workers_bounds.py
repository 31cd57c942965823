"""Every wait a request can ask for has an operator's upper bound, checked at submission (issue 24,
item 2): verification deadlines, attention-scoring calls, learner waits; and a rollout group that runs
past its bound is abandoned, so its worker slot is free for the next one."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loom.contracts.settings import Settings
from loom.contracts.tasks import GENERATE_GROUP
from loom.contracts.wire import Group, RolloutRequest
from loom.queue import send
from rollout_svc.config import RolloutSettings
from tests.rollout.conftest import start_engine_server, stop_process
from tests.security import workers_fixtures
from tests.security.workers_fixtures import tree_request
from tests.security.workers_listener import Listener

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, JOBS_KEY, RUNS_KEY, auth  # noqa: E402

engine_url = workers_fixtures.engine_url
rollout = workers_fixtures.rollout


def _group() -> dict[str, Any]:
    return {"id": "g", "label": "42", "trajectories": [{"id": "t0", "group_id": "g", "text": "\\boxed{42}"}]}


def test_a_verification_deadline_above_the_operators_bound_is_a_422_at_the_reward_service() -> None:
    from reward_svc.api import app

    bound = 30  # LOOM_REWARD_MAX_TIMEOUT_S's default
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/rewards", json={"groups": [_group()], "spec": {"timeout_s": bound + 1}})
        assert r.status_code == 422, r.text
        assert r.json()["detail"][0]["loc"] == ["body", "spec", "timeout_s"]
        assert "LOOM_REWARD_MAX_TIMEOUT_S" in r.json()["detail"][0]["msg"]
        r = client.post("/v1/rewards/match", json={"texts": ["\\boxed{1}"], "label": "1", "timeout_s": 300})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "timeout_s"]
        for path, body in (
            ("/get_reward", {"query": ["\\boxed{1}"]}),
            ("/v1/slime/reward", {"response": "1"}),
        ):
            r = client.post(path, json={**body, "spec": {"timeout_s": 300}})
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "spec", "timeout_s"]
        r = client.post("/v1/rewards", json={"groups": [_group()], "spec": {"timeout_s": bound}})
        assert r.status_code == 200 and r.json()["results"][0]["rewards"][0]["total"] == 1.0


def _gateway(tmp_path: Path, **overrides: Any) -> TestClient:
    from gateway.api import build_app
    from gateway.config import GatewaySettings
    from loom.queue import make_celery

    settings = Settings(
        data_dir=tmp_path,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
        **overrides,
    )
    config = GatewaySettings(run_loop=False)
    return TestClient(build_app(settings, celery_app=make_celery("gateway", settings), config=config))


def test_the_gateway_refuses_waits_above_the_operators_bounds_at_submission(tmp_path: Path) -> None:
    with _gateway(tmp_path, attention_timeout_s=30.0) as client:
        job = {"job_key": "a", "prompts": ["p"], "reward": {"timeout_s": 300}}
        r = client.post("/v1/jobs", json=job, headers=auth(JOBS_KEY))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "reward", "timeout_s"]
        for value in (1e9, 31.0, 0.0):
            job = {"job_key": f"b{value}", "prompts": ["p"], "mode": "tree"}
            job["mode_params"] = {"attention_timeout_s": value}
            r = client.post("/v1/jobs", json=job, headers=auth(JOBS_KEY))
            assert r.status_code == 422, (value, r.text)
            assert r.json()["detail"][0]["loc"] == ["body", "mode_params"]
            assert "LOOM_ATTENTION_TIMEOUT_S" in r.json()["detail"][0]["msg"]
        run = {"dataset": {"builtin": "arith", "size": 4}, "mode": "tree"}
        run["mode_params"] = {"strategy": "entropy", "attention_timeout_s": 1e9}
        r = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "mode_params"]
        job = {"job_key": "ok", "prompts": ["p"], "mode": "tree", "mode_params": {"attention_timeout_s": 30}}
        assert client.post("/v1/jobs", json=job, headers=auth(JOBS_KEY)).status_code == 201


def _batch() -> dict[str, Any]:
    from loom.contracts.wire import Group, RewardResult, TrainBatch, Trajectory, TrajectoryReward

    trajs = [Trajectory(id=f"t{i}", group_id="g", prompt_ids=[1], completion_ids=[2, 3]) for i in range(2)]
    rewards = [TrajectoryReward(trajectory_id=f"t{i}", total=float(i)) for i in range(2)]
    batch = TrainBatch(
        step=0,
        groups=[Group(id="g", trajectories=trajs)],
        rewards=[RewardResult(group_id="g", rewards=rewards)],
    )
    return batch.model_dump(mode="json")


@pytest.mark.parametrize("route", ["train_step", "score_attention"])
def test_a_learner_wait_above_the_operators_bound_is_a_422_before_any_queue(
    tmp_path: Path, route: str
) -> None:
    from learner.api import build_app
    from learner.config import LearnerSettings
    from loom.queue import make_celery

    settings = Settings(data_dir=tmp_path / "d")
    app = build_app(settings, make_celery("learner", settings), LearnerSettings(max_wait_s=60.0))
    with TestClient(app, raise_server_exceptions=False) as client:
        if route == "train_step":
            r = client.post("/v1/train_step", json=_batch(), params={"timeout": 61})
            loc = ["query", "timeout"]
        else:
            body = {"token_ids": [1, 2, 3], "steps": [[0, 1], [1, 3]], "timeout": 61}
            r = client.post("/v1/score/attention", json=body)
            loc = ["body", "timeout"]
        assert r.status_code == 422, r.text
        assert loc in [e["loc"] for e in r.json()["detail"]]
        assert "LOOM_LEARNER_MAX_WAIT_S" in r.text


def test_a_group_past_its_bound_is_abandoned_with_a_typed_504(rollout: Any) -> None:
    """A scorer that answers, but 1.5 s per call: each call is within its own bound, the group is not
    (2 responses, 2 calls, 2 s): it is abandoned with ``group_timeout`` at its bound."""
    client, use = rollout
    with Listener("scores", delay=1.5) as scorer:
        use(attention_url=scorer.url, rollout=RolloutSettings(group_timeout_s=2.0))
        t0 = time.monotonic()
        r = client.post("/v1/rollouts", json=tree_request())
        assert r.status_code == 504, r.text
        assert r.json()["error"] == "group_timeout" and "LOOM_ROLLOUT_GROUP_TIMEOUT_S" in r.json()["detail"]
        assert time.monotonic() - t0 < 30  # abandoned at its bound, not after every call (unbounded before)
        assert scorer.connections >= 1
        use(attention_url=scorer.url)  # the default bound (600 s): the same group completes
        assert client.post("/v1/rollouts", json=tree_request()).status_code == 200


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_a_scorer_that_never_answers_frees_the_slot_and_a_plain_job_completes_beside_it(
    broker_env: Any, loom_worker: Any
) -> None:
    """The issue's stall: a rollout worker with one engine slot on a vLLM-protocol engine, the
    operator's scorer accepting connections and never answering. The tree group gives up after
    LOOM_ATTENTION_TIMEOUT_S with a typed error, and a plain group submitted behind it completes. A
    tree group sent straight to the queue with a URL of its own is refused by the worker, which never
    contacts it."""
    proc, url = start_engine_server(["--model", "tiny"])
    try:
        with Listener("silent") as scorer, Listener("secret") as hostile:
            broker_env.extra_env.update(
                LOOM_ENGINE="vllm",
                LOOM_ENGINE_URL=url,
                LOOM_ATTENTION_URL=scorer.url,
                LOOM_ATTENTION_TIMEOUT_S="3",
            )
            app = broker_env.app("rollout")
            loom_worker("rollout", broker_env, concurrency=1)
            tag = uuid.uuid4().hex[:8]

            def submit(gid: str, body: dict[str, Any]) -> Any:
                request = RolloutRequest.model_validate({**body, "group_id": gid})
                return send(app, GENERATE_GROUP, request, key=gid)

            stuck = submit(f"tree-{tag}", tree_request())
            deadline = time.monotonic() + 120
            while scorer.connections == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert scorer.connections >= 1  # the tree group is inside its scoring call
            plain = submit(f"plain-{tag}", {"prompt": "Compute 2+2.", "sampling": {"n": 2, "max_tokens": 8}})
            group = Group.model_validate(plain.get(timeout=120))
            assert group.id == f"plain-{tag}" and len(group.trajectories) == 2
            with pytest.raises(Exception, match="did not answer within 3.0 s") as caught:
                stuck.get(timeout=60)
            assert type(caught.value).__name__ == "ScorerTimeout"

            refused = submit(f"url-{tag}", tree_request(attention_url=hostile.url + "/admin?x="))
            with pytest.raises(Exception, match="attention_url is not accepted"):
                refused.get(timeout=60)
            assert hostile.connections == 0
    finally:
        stop_process(proc)
