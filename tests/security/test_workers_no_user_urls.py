"""No worker ever fetches a URL a user submitted (issue 24, item 1), and what an operator's outbound
endpoint answers never reaches a user beyond a typed status.

The rollout service runs in-process on the vLLM protocol client against a real ``loom engine`` (the
built-in tiny model): that engine has no attention scores of its own, which is when tree mode's
attention branching calls a scorer. A real TCP listener stands where a hostile user points the
worker, and records every connection: there must be none."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from loom.contracts.settings import Settings
from tests.security import workers_fixtures
from tests.security.workers_fixtures import tree_request
from tests.security.workers_listener import SECRET, Listener

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, JOBS_KEY, RUNS_KEY, auth  # noqa: E402

engine_url = workers_fixtures.engine_url
rollout = workers_fixtures.rollout


def hostile_urls(listener: Listener) -> list[str]:
    return [
        f"{listener.url}/internal/admin/secret?x=",  # the issue's: ?x= swallows /v1/score/attention
        f"{listener.url}/internal/admin/secret#",
        listener.url,
        "file:///etc/passwd",
        f"gopher://127.0.0.1:{listener.port}/",
    ]


def test_a_submitted_attention_url_is_a_422_and_the_listener_is_never_contacted(rollout: Any) -> None:
    client, _ = rollout
    with Listener("secret") as listener:
        for url in hostile_urls(listener):
            r = client.post("/v1/rollouts", json=tree_request(attention_url=url))
            assert r.status_code == 422, (url, r.status_code, r.text)
            assert r.json()["error"] == "mode_error" and "attention_url" in r.json()["detail"]
            assert SECRET not in r.text
        assert listener.connections == 0


def test_the_gateway_refuses_a_submitted_attention_url_at_submission(tmp_path: Path) -> None:
    from gateway.api import build_app
    from gateway.config import GatewaySettings
    from loom.queue import make_celery

    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS
    )
    app = build_app(
        settings, celery_app=make_celery("gateway", settings), config=GatewaySettings(run_loop=False)
    )
    with Listener("secret") as listener, TestClient(app) as client:
        for i, url in enumerate(hostile_urls(listener)):
            params = {"attention_url": url}
            job = {"job_key": f"k{i}", "prompts": ["p"], "mode": "tree", "mode_params": params}
            r = client.post("/v1/jobs", json=job, headers=auth(JOBS_KEY))
            assert r.status_code == 422, (url, r.text)
            assert [e["loc"] for e in r.json()["detail"]] == [["body", "mode_params"]]
            job = {"job_key": f"t{i}", "mode": "tree", "tasks": [{"prompt": "p", "mode_params": params}]}
            r = client.post("/v1/jobs", json=job, headers=auth(JOBS_KEY))
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == [
                "body",
                "tasks",
                0,
                "mode_params",
            ]
            run = {"dataset": {"builtin": "arith", "size": 4}, "mode": "tree", "mode_params": params}
            r = client.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
            assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "mode_params"]
        assert listener.connections == 0


def test_the_operators_scorer_is_called_with_the_service_token(rollout: Any) -> None:
    client, use = rollout
    with Listener("scores") as scorer:
        use(attention_url=scorer.url, service_token="s3rvice-token")
        r = client.post("/v1/rollouts", json=tree_request())
        assert r.status_code == 200, r.text
        assert scorer.requests and all(
            q["line"].startswith("POST /v1/score/attention ")
            and q["headers"]["authorization"] == "Bearer s3rvice-token"
            for q in scorer.requests
        )
        # the policy the engine generates with (a request without a version: the base model, 0)
        bodies = [json.loads(q["body"]) for q in scorer.requests]
        assert all((b["policy_version"], b["policy_namespace"]) == (0, None) for b in bodies)
        assert r.json()["meta"]["mean_fci"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("behaviour", "status"), [("secret", "is not a list of"), ("error", "answered HTTP 500")]
)
def test_what_a_misbehaving_scorer_answers_never_reaches_the_user(
    rollout: Any, behaviour: str, status: str
) -> None:
    """A 200 without ``scores`` (a KeyError, a 500, before) and an error status: a typed error that
    says what went wrong, never what the scorer said."""
    client, use = rollout
    with Listener(behaviour) as scorer:
        use(attention_url=scorer.url)
        r = client.post("/v1/rollouts", json=tree_request())
        assert r.status_code == 503, r.text
        assert r.json()["error"] == "attention_scorer_error" and status in r.json()["detail"]
        assert SECRET not in r.text and str(scorer.port) not in r.text
        assert scorer.connections >= 1


def test_an_attention_url_setting_must_be_http() -> None:
    for bad in ("file:///etc/passwd", "gopher://127.0.0.1:70/", "127.0.0.1:8404", "http://"):
        with pytest.raises(ValidationError, match="attention_url"):
            Settings(attention_url=bad)
    assert Settings(attention_url="https://learner:8404").attention_url == "https://learner:8404"


def test_the_reflection_models_reply_never_reaches_the_error_text() -> None:
    from reflect_svc.reflection_model import ModelError, ReflectionModel

    for behaviour in ("error", "secret"):
        with Listener(behaviour) as model:
            with pytest.raises(ModelError) as caught:
                ReflectionModel(model.url, timeout_s=10).label("prompt", 2)
            assert SECRET not in str(caught.value) and model.connections == 1
