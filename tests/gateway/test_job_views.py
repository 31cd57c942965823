"""A job's view a page at a time, and what a failed job's error may say (docs/security.md, "Error
answers of every service"): a real gateway app on its own database."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.jobs import job_error
from gateway.models import JobRequest
from loom.contracts.modes import TreeParams
from tests.gateway.helpers import JOBS_KEY, auth
from tests.gateway.test_api import make_client


def test_a_large_jobs_view_and_page_come_a_bounded_page_at_a_time(tmp_path: Path) -> None:
    """``GET /v1/jobs/{id}`` of a 4,096-trajectory job read and rendered all of it (6 MB) on the event
    loop: another key's small GET went from 92 ms to 2.2 s. Now a page is bounded and read off it."""
    with make_client(tmp_path) as client:
        body = {"job_key": "big", "prompts": [f"Compute {i}+1." for i in range(100)]}
        job_id = client.post("/v1/jobs", json=body, headers=auth(JOBS_KEY)).json()["id"]
        state = client.app.state.gateway.state  # type: ignore[attr-defined]
        state.jobs.add_groups(
            job_id, [(i, {"index": i, "group": None, "rewards": None}) for i in range(99, -1, -1)]
        )

        first = client.get(f"/v1/jobs/{job_id}", headers=auth(JOBS_KEY)).json()
        assert first["n_done"] == 100 and len(first["groups"]) == 64 and first["next_offset"] == 64
        assert [g["index"] for g in first["groups"]] == list(range(64))  # prompt order
        rest = client.get(f"/v1/jobs/{job_id}?offset=64", headers=auth(JOBS_KEY)).json()
        assert [g["index"] for g in rest["groups"]] == list(range(64, 100)) and rest["next_offset"] is None
        small = client.get(f"/v1/jobs/{job_id}?offset=10&limit=5", headers=auth(JOBS_KEY)).json()
        assert [g["index"] for g in small["groups"]] == list(range(10, 15)) and small["next_offset"] == 15
        assert client.get(f"/v1/jobs/{job_id}?limit=100000", headers=auth(JOBS_KEY)).status_code == 422

        page = client.get(f"/ui/jobs/{job_id}", headers=auth(JOBS_KEY))
        assert page.status_code == 200 and f"/ui/jobs/{job_id}?offset=64" in page.text
        assert "groups 100 / 100" in page.text


class PolicyLoadError(Exception):
    """The name a worker's failure has when Celery rebuilds it in the gateway."""


class ModeError(Exception):
    pass


def test_a_failed_jobs_error_is_typed_and_names_no_server_path() -> None:
    """A job's error was the worker's exception copied in: ``PolicyLoadError: could not load policy
    '<data dir>/policy/ns/<key>/v3'``, and any other exception's text as it was."""
    req = JobRequest(job_key="j", prompts=["x"], policy_version=3, policy_namespace="alice")
    path = "/srv/loom/data/policy/ns/alice/v3"
    error = job_error(
        PolicyLoadError(f"could not load policy {path!r}: no file named model.safetensors"), req, "job-1"
    )
    assert error.startswith("policy_load_error: policy version 3") and "/srv" not in error
    error = job_error(ModeError(f"tree mode cannot read {path}/tokenizer.json"), req, "job-1")
    assert error.startswith("invalid_params: tree mode cannot read") and "/srv" not in error
    error = job_error(OverflowError(f"int too big to convert ({path})"), req, "job-1")
    assert error.startswith("internal_error") and "/srv" not in error and "OverflowError" not in error


def test_a_tree_delta_no_sequence_can_hold_is_refused_at_submission() -> None:
    """``delta`` 1e30 was accepted (201) and then failed in the worker with an OverflowError."""
    with pytest.raises(ValidationError, match="delta"):
        TreeParams.model_validate({"initial": 2, "delta": 1e30, "attention_timeout_s": 1.0})
    with pytest.raises(ValidationError, match="min_distance"):
        TreeParams.model_validate({"initial": 2, "min_distance": 10**30, "attention_timeout_s": 1.0})
