"""The run page's guards (gateway/auth.py sessions, gateway/routes/web.py): without a session or key no
page data, only the login form; the key goes in a POST body and comes back as an HttpOnly,
SameSite=Strict session cookie that counts on /ui only; scopes and owners as on /v1. In-process app on
a real embedded broker in tmp_path (no run loop: the run's steps are recorded through the state)."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from helpers import ADMIN_KEY, API_KEYS, JOBS_KEY, RUNS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from gateway.stepmetrics import step_metrics  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.contracts.wire import Group, RewardResult, Trajectory, TrajectoryReward  # noqa: E402
from loom.queue import make_celery  # noqa: E402

RUN = {"dataset": {"builtin": "arith", "size": 4}, "schedule": {"steps": 3, "batch_size": 1}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(
        data_dir=tmp_path,
        broker_url="embedded",
        result_backend="embedded",
        api_keys=API_KEYS,
    )
    celery_app = make_celery("gateway", settings)
    with TestClient(build_app(settings, celery_app=celery_app, config=GatewaySettings(run_loop=False))) as c:
        yield c


def login(client: TestClient, key: str) -> httpx.Response:
    """As a browser does: the form (its token in a hidden field and a cookie), then the post."""
    form = client.get("/ui/login")
    token = re.search(r'name="login_token" value="([^"]+)"', form.text)
    assert form.status_code == 200 and token is not None
    return client.post(
        "/ui/login",
        content=f"login_token={token[1]}&api_key={key}",
        headers={"Content-Type": "application/x-www-form-urlencoded"},
        follow_redirects=False,
    )


def scored(step: int) -> tuple[Group, RewardResult]:
    trajectories = [
        Trajectory(id=f"g{step}/{i}", group_id=f"g{step}", completion_ids=[1, 2, 3], text=f"answer {i}")
        for i in range(2)
    ]
    rewards = [
        TrajectoryReward(trajectory_id=t.id, total=float(i), components={"accuracy": float(i), "format": 0.5})
        for i, t in enumerate(trajectories)
    ]
    group = Group(id=f"g{step}", prompt=f"Compute {step}+1.", label=str(step + 1), trajectories=trajectories)
    return group, RewardResult(group_id=group.id, rewards=rewards)


def test_without_a_session_the_pages_redirect_to_login_and_data_answers_401(client: TestClient) -> None:
    run_id = client.post("/v1/runs", json=RUN, headers=auth(RUNS_KEY)).json()["id"]
    for path in ("/ui/", f"/ui/runs/{run_id}", "/ui/jobs/job-x"):
        r = client.get(path, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/login", path
        assert run_id not in r.text
    for path in (f"/ui/runs/{run_id}/events", f"/ui/runs/{run_id}/steps.json"):
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"] == "unauthenticated", path
    # a forged cookie is no session
    client.cookies.set("loom_session", "forged", path="/ui")
    assert client.get(f"/ui/runs/{run_id}/steps.json").status_code == 401
    assert client.get("/ui/login").status_code == 200  # the form and its static files are open
    assert client.get("/ui/static/uPlot.iife.min.js").status_code == 200


def test_login_sets_a_strict_httponly_session_that_counts_on_ui_only(client: TestClient) -> None:
    run_id = client.post("/v1/runs", json=RUN, headers=auth(RUNS_KEY)).json()["id"]
    bad = login(client, "loom_not_a_key")
    assert bad.status_code == 401 and "set-cookie" not in bad.headers
    r = login(client, RUNS_KEY)
    assert r.status_code == 303 and r.headers["location"] == "/ui/"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/ui" in cookie
    assert RUNS_KEY not in cookie and RUNS_KEY not in r.headers["location"]
    page = client.get("/ui/")
    assert page.status_code == 200 and run_id in page.text and RUNS_KEY not in page.text
    # the session is not an API credential, even when its cookie is sent there
    sid = cookie.split(";")[0].split("=", 1)[1]
    assert client.get(f"/v1/runs/{run_id}", headers={"Cookie": f"loom_session={sid}"}).status_code == 401
    assert client.post("/ui/logout", follow_redirects=False).status_code == 303
    client.cookies.clear()
    client.cookies.set("loom_session", sid, path="/ui")
    assert client.get("/ui/", follow_redirects=False).status_code == 303  # logged out: the id is dead


def test_scopes_and_owners_hold_on_the_page(client: TestClient) -> None:
    run_id = client.post("/v1/runs", json=RUN, headers=auth(RUNS_KEY)).json()["id"]
    assert client.get(f"/ui/runs/{run_id}", headers=auth(JOBS_KEY)).status_code == 403  # no runs scope
    login(client, ADMIN_KEY)  # another key: the run is not its own
    assert client.get(f"/ui/runs/{run_id}").status_code == 404
    assert run_id not in client.get("/ui/").text


def test_a_runs_steps_and_samples_reach_the_page(client: TestClient, tmp_path: Path) -> None:
    run_id = client.post("/v1/runs", json=RUN, headers=auth(RUNS_KEY)).json()["id"]
    state = client.app.state.gateway_state  # type: ignore[attr-defined]
    for step in range(2):
        kept = [scored(step), None]
        # as the run loop does (gateway/runs.py): the samples, then the step with its metrics
        state.runs.add_samples(run_id, step, [scored(99)])
        state.runs.add_samples(run_id, step, [g for g in kept if g is not None])  # a re-walk replaces
        metrics = {"step": step, "policy_version": step + 1, **step_metrics(kept, kept[:1], 1.0)}
        assert state.runs.complete_step(run_id, step, metrics, 1, 1)
    assert [(r["step"], r["idx"], r["group_id"]) for r in state.runs.samples(run_id)] == [
        (0, 0, "g0"),
        (1, 0, "g1"),
    ]
    login(client, RUNS_KEY)
    points = client.get(f"/ui/runs/{run_id}/steps.json").json()
    assert [p["step"] for p in points] == [0, 1]
    assert [(p["reward/accuracy"], p["reward/format"]) for p in points] == [(0.5, 0.5)] * 2
    # the same points as the API's metrics
    assert points == client.get(f"/v1/runs/{run_id}/metrics", headers=auth(RUNS_KEY)).json()
    with client.stream("GET", f"/ui/runs/{run_id}/events", headers={"Last-Event-ID": "0"}) as events:
        lines = []
        for line in events.iter_lines():
            lines.append(line)
            if line.startswith("id: "):
                break
    assert lines[:2] == ["event: step", "id: 1"]
    page = client.get(f"/ui/runs/{run_id}").text
    assert "Samples of step 1" in page and "Compute 1+1." in page and 'data-trajectory="g1/1"' in page
    assert "Compute 0+1." in client.get(f"/ui/runs/{run_id}?step=0").text


def test_a_runs_answer_names_its_lineage_and_its_samples_are_read_through_the_api(
    client: TestClient,
) -> None:
    """``GET /v1/runs/{id}``: the run's own namespace, its base and the versions it published;
    ``GET /v1/runs/{id}/samples``: the scored groups the run page shows, for the run's key only."""
    run_id = client.post("/v1/runs", json=RUN, headers=auth(RUNS_KEY)).json()["id"]
    state = client.app.state.gateway_state  # type: ignore[attr-defined]
    for step in range(2):
        state.runs.add_samples(run_id, step, [scored(step)])
        assert state.runs.complete_step(run_id, step, {"step": step, "policy_version": step + 1}, step + 1, 1)
    run = client.get(f"/v1/runs/{run_id}", headers=auth(RUNS_KEY)).json()
    assert run["lineage"] == {"namespace": run_id, "base_namespace": None, "base_version": 0}
    assert run["versions"] == [1, 2] and run["policy_version"] == 2
    samples = client.get(f"/v1/runs/{run_id}/samples", headers=auth(RUNS_KEY)).json()
    assert [(s["step"], s["group_id"]) for s in samples] == [(0, "g0"), (1, "g1")]
    one = client.get(f"/v1/runs/{run_id}/samples", params={"step": 1}, headers=auth(RUNS_KEY)).json()
    assert [Group.model_validate(s["group"]).id for s in one] == ["g1"]
    assert client.get(f"/v1/runs/{run_id}/samples", headers=auth(ADMIN_KEY)).status_code == 404
