"""Each mode's parameters are parsed once per trainer request (docs/architecture.md, "Contracts"):
the trainer client builds the job, the gateway parses and resolves it at submission, and the job's
groups run through the real rollout core (launch/inprocess.py, the torch engine on the tiny model)
without a second parse. ``parse_mode_params`` is wrapped in every module that holds it, so a parse
anywhere in the path counts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.jobs import run_job
from launch.inprocess import InProcessStages
from loom.clients.rollouts import RolloutGroup, job_body
from loom.contracts import modes
from loom.contracts.settings import Settings
from loom.contracts.wire import RolloutRequest
from tests.gateway.helpers import JOBS_KEY, RUNS_KEY, auth
from tests.gateway.test_api import make_client


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The modes of every ``parse_mode_params`` call from now on, in any module of this process."""
    calls: list[str] = []
    original = modes.parse_mode_params

    def counted(request: RolloutRequest, limits: modes.ModeLimits | None = None) -> modes.ModeParams:
        calls.append(request.mode)
        return original(request, limits)

    for module in list(sys.modules.values()):
        if getattr(module, "parse_mode_params", None) is original:
            monkeypatch.setattr(module, "parse_mode_params", counted)
    return calls


@pytest.fixture(scope="module")
def stages() -> Iterator[InProcessStages]:
    from rollout_svc.engines import make_engine

    engine = make_engine(Settings().model_copy(update={"engine_process": False, "device": "cpu"}))
    s = InProcessStages(engine)
    yield s
    s.close()


def submit_and_run(tmp_path: Path, stages: InProcessStages, body: dict[str, Any]) -> list[RolloutGroup]:
    """``body`` submitted to a gateway and its job run to the end; the groups as the client reads them."""
    with make_client(tmp_path) as client:
        r = client.post("/v1/jobs", json=body, headers=auth(JOBS_KEY))
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        state = client.app.state.gateway.state  # type: ignore[attr-defined]
        assert asyncio.run(run_job(job_id, state, stages)) == "succeeded"
        view = client.get(f"/v1/jobs/{job_id}", headers=auth(JOBS_KEY)).json()
    return [RolloutGroup.from_event(g) for g in view["groups"]]


def test_a_jobs_shared_mode_params_are_parsed_once(
    tmp_path: Path, stages: InProcessStages, parses: list[str]
) -> None:
    tree = {"strategy": "random", "branches": 1, "continuations": 1, "initial": 2, "min_distance": 2}
    body = job_body(
        ["Compute 2+3.", "Compute 4+1."], mode="tree", mode_params=tree, sampling={"max_tokens": 8}
    )
    groups = submit_and_run(tmp_path, stages, body)
    assert len(groups) == 2 and all(g.group is not None and g.group.tree for g in groups)
    assert parses == ["tree"]  # one job, one set of mode params: one parse, at the gateway


def test_each_items_own_mode_params_are_parsed_once(
    tmp_path: Path, stages: InProcessStages, parses: list[str]
) -> None:
    items = [
        {"prompt": "Read:", "mode_params": {"sentences": ["Add 2 and 3."]}},
        {"prompt": "Read:", "mode_params": {"sentences": ["Add 4 and 1.", "Then stop."]}},
    ]
    common = {"segment_cap": 4, "deep_max_tokens": 4, "answer_max_tokens": 4}
    body = job_body(items, mode="streaming", mode_params=common, sampling={"max_tokens": 8})
    groups = submit_and_run(tmp_path, stages, body)
    assert len(groups) == 2 and all(g.group is not None for g in groups)
    assert parses == ["streaming", "streaming"]  # one parse per item, none after the gateway's


def test_a_direct_rollout_request_is_parsed_by_the_rollout_service(
    stages: InProcessStages, parses: list[str]
) -> None:
    """``/v1/rollouts`` is an edge: it parses what it is sent, also a form that claims to be resolved
    (a bad value in it is the 422 naming it, not a group)."""
    from rollout_svc.api import app
    from rollout_svc.engines import set_engine

    request = RolloutRequest(
        prompt="Compute 2+3.", mode="tree", mode_params={"strategy": "random", "initial": 2}
    )
    form = modes.resolved_form(modes.parse_mode_params(request))
    parses.clear()
    body = request.model_dump(mode="json") | {"mode_params_resolved": True}
    set_engine(stages.engine)
    try:
        with TestClient(app) as client:
            bad = client.post("/v1/rollouts", json=body | {"mode_params": form | {"branches": 100}})
            good = client.post(
                "/v1/rollouts", json=body | {"mode_params": form | {"branches": 1, "continuations": 1}}
            )
    finally:
        set_engine(None)
    assert bad.status_code == 422 and "mode_params.branches must be in [0, 64]" in bad.text
    assert good.status_code == 200 and good.json()["tree"], good.text
    assert parses == ["tree", "tree"]


def test_a_runs_rollout_requests_are_parsed_once_each_at_the_gateway(
    tmp_path: Path, stages: InProcessStages, parses: list[str]
) -> None:
    """A run's items enter at the gateway: its loop parses each step's requests there, and the
    rollout core takes them without a second parse (the submission's check is the run's own)."""
    from gateway.runs import RunLoop
    from gateway.trackers import Trackers

    tree = {"strategy": "random", "branches": 1, "continuations": 1, "initial": 2, "min_distance": 2}
    body = {
        "dataset": {"builtin": "arith", "size": 4},
        "mode": "tree",
        "mode_params": tree,
        "sampling": {"n": 2, "max_tokens": 8},
        "schedule": {"steps": 1, "batch_size": 2},
    }
    with make_client(tmp_path) as client:
        r = client.post("/v1/runs", json=body, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text
        state = client.app.state.gateway.state  # type: ignore[attr-defined]
        assert parses == ["tree"]  # the submission's check
        parses.clear()
        loop = RunLoop(r.json()["id"], state, stages, tmp_path, trackers=Trackers([]))
        gen = asyncio.run(loop.generate(0, 2, 0))
    assert len(gen.collected.groups) == 2 and all(g is not None and g[0].tree for g in gen.collected.groups)
    assert parses == ["tree", "tree"]  # one per rollout request, none in the rollout core
