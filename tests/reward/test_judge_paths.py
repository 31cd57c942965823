"""The judge component through the trainer protocols the reward API serves (OpenRLHF ``/get_reward``,
slime ``/v1/slime/reward`` and ``/components``, ``/v1/rewards``): its score, status and per-component
breakdown as for the rule-based components (docs/interop-reward.md "Judge rewards")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.reward.test_judge import INJECTIONS, Judge, judge, spec  # noqa: F401  (judge: the fixture)

SPEC = {"components": [{"name": "judge", "params": {"judge": "j"}}, {"name": "format_think", "weight": 0.5}]}


@pytest.fixture()
def api(judge: tuple[Judge, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Judge, TestClient]]:  # noqa: F811
    """The reward API with LOOM_REWARD_JUDGES naming the test judge ``j``."""
    from loom.contracts.reward_settings import get_reward_settings
    from reward_svc.api import app
    from reward_svc.tasks import judge_client

    j, url = judge
    shared = judge_client.__self__  # type: ignore[attr-defined]
    monkeypatch.setenv("LOOM_REWARD_JUDGES", json.dumps({"j": {"url": url, "model": "ok"}}))
    get_reward_settings.cache_clear()
    shared.close()
    try:
        with TestClient(app) as c:
            yield j, c
    finally:
        monkeypatch.delenv("LOOM_REWARD_JUDGES")
        get_reward_settings.cache_clear()
        shared.close()


def test_openrlhf_get_reward(api: tuple[Judge, TestClient]) -> None:
    j, c = api
    queries = ["Q? 42", "Q? 41", "Q? " + INJECTIONS[0]]
    body: dict[str, Any] = {"query": queries, "prompts": ["Q?"] * 3, "labels": ["42"] * 3, "spec": SPEC}
    r = c.post("/get_reward", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["extra_logs"]["judge"] == [1.0, 0.0, 0.0]
    assert out["extra_logs"]["format_think"] == [0.0, 0.0, 0.0]
    assert out["extra_logs"]["status_ok"] == [1.0, 1.0, 1.0]
    assert out["rewards"] == [1.0, 0.0, 0.0]
    assert len(j.prompts) == 3


def test_slime_reward_and_components(api: tuple[Judge, TestClient]) -> None:
    _, c = api
    r = c.post("/v1/slime/reward", json={"prompt": "p", "response": "42", "label": "42", "spec": SPEC})
    assert r.status_code == 200 and r.json() == 1.0, r.text
    body = {"prompt": "p", "response": INJECTIONS[1], "label": "42", "spec": SPEC}
    out = c.post("/v1/slime/reward/components", json=body).json()
    assert out["judge"] == 0.0 and out["components"]["judge"] == 0.0
    assert out["reward"] == 0.0 and out["status"] == "ok"


def test_rewards_breakdown_and_a_missing_judge_is_typed(api: tuple[Judge, TestClient]) -> None:
    _, c = api
    trajs = [{"id": f"t{i}", "group_id": "g", "text": t} for i, t in enumerate(["42", "41"])]
    g = {"id": "g", "prompt": "What is 6*7?", "label": "42", "trajectories": trajs}
    out = c.post("/v1/rewards", json={"groups": [g], "spec": SPEC}).json()["results"][0]["rewards"]
    assert [(x["components"]["judge"], x["components"]["format_think"], x["status"]) for x in out] == [
        (1.0, 0.0, "ok"),
        (0.0, 0.0, "ok"),
    ]
    missing = spec(judge="nobody").model_dump()
    out = c.post("/v1/rewards", json={"groups": [g], "spec": missing}).json()["results"][0]["rewards"]
    assert [(x["components"]["judge"], x["status"]) for x in out] == [(0.0, "judge_unavailable")] * 2


@pytest.mark.broker
def test_a_reward_worker_asks_the_judge(broker_env, loom_worker, judge) -> None:  # noqa: F811
    """A real ``loom worker reward`` over the broker (embedded and RabbitMQ): ``reward.score_groups``
    with the judge component, its scores and typed statuses in the stored breakdown."""
    import uuid

    from loom.contracts.wire import RewardResult
    from tests.reward.test_judge import group
    from tests.reward.test_score_groups import _wait

    j, url = judge
    broker_env.extra_env.update(
        LOOM_REWARD_WORKERS="1", LOOM_REWARD_JUDGES=json.dumps({"j": {"url": url, "model": "ok"}})
    )
    loom_worker("reward", broker_env)
    app = broker_env.app("gateway")
    key = f"j{uuid.uuid4().hex[:8]}.score"
    g = group("42", "41", INJECTIONS[1]).model_dump(mode="json")
    bad = group("42").model_dump(mode="json")  # the same group, scored by a judge not configured
    members = [
        [key, g, spec().model_dump(mode="json")],
        [key + "2", bad, spec(judge="nobody").model_dump(mode="json")],
    ]
    app.send_task("reward.score_groups", args=[members], task_id=f"scores-{uuid.uuid4().hex}")
    result = RewardResult.model_validate(_wait(app, key, 60)["result"])
    assert [(r.components["judge"], r.status) for r in result.rewards] == [
        (1.0, "ok"),
        (0.0, "ok"),
        (0.0, "ok"),
    ]
    missing = RewardResult.model_validate(_wait(app, key + "2", 60)["result"])
    assert [(r.components["judge"], r.status) for r in missing.rewards] == [(0.0, "judge_unavailable")]
    assert len(j.prompts) == 3
