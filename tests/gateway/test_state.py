"""The gateway's SQLite state (gateway/state.py): typed rows, keyword-only creation, ``Conflict`` for an
idempotency key that names different work, the start and finish rules of jobs and runs, and a database
written before the cost columns existed still read. And the run loop's look-ahead (gateway/runs.py)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from gateway.models import JobRequest, RunRequest
from gateway.quotas import Cost, QuotaExceeded, Quotas
from gateway.runs import Generated, LookAhead, Position
from gateway.state import Conflict, GatewayState, JobRow, RunRow

JOB = JobRequest.model_validate({"job_key": "k1", "prompts": ["1+1=?", "2+2=?"]})
RUN = RunRequest.model_validate({"dataset": {"builtin": "arith", "size": 8}, "schedule": {"steps": 3}})


def test_rows_are_typed_with_their_json_read(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "gw.sqlite")
    job_id, created = state.jobs.create(owner="me", request=JOB, cost=Cost(4, 400))
    run_id, _ = state.runs.create(owner="me", request=RUN)
    job, run = state.jobs.get(job_id), state.runs.get(run_id)
    assert created and isinstance(job, JobRow) and isinstance(run, RunRow)
    assert (job.owner, job.job_key, job.status, job.n_prompts) == ("me", "k1", "queued", 2)
    assert (job.samples, job.tokens, job.counters, job.error) == (4, 400, {}, None)
    assert JobRequest.model_validate(job.request) == JOB
    assert (run.run_key, run.total_steps, run.policy_version, run.batch_size) == (None, 3, 0, 8)
    assert RunRequest.model_validate(run.config) == RUN and run.completed_steps == 0
    assert state.jobs.get("job-none") is None and state.runs.get(job_id) is None  # a job is no run


def test_creation_takes_keywords_only(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "gw.sqlite")
    with pytest.raises(TypeError):
        state.runs.create("me", RUN)  # type: ignore[misc]


def test_a_key_naming_a_different_request_is_a_conflict_not_a_new_job(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "gw.sqlite")
    job_id, _ = state.jobs.create(owner="me", request=JOB)
    assert state.jobs.create(owner="me", request=JOB) == (job_id, False)
    other = JOB.model_copy(update={"prompts": ["3+3=?"]})
    with pytest.raises(Conflict) as caught:
        state.jobs.create(owner="me", request=other)
    assert caught.value.item_id == job_id and not isinstance(caught.value, KeyError)
    assert state.jobs.create(owner="you", request=other)[1]  # keys are per owner
    keyed = RUN.model_copy(update={"run_key": "r"})
    run_id, _ = state.runs.create(owner="me", request=keyed)
    with pytest.raises(Conflict):
        state.runs.create(owner="me", request=keyed.model_copy(update={"estimator": "dr_grpo"}))
    assert state.runs.create(owner="me", request=RUN)[0] != state.runs.create(owner="me", request=RUN)[0]
    assert state.runs.with_status("queued")[:1] == [run_id]  # oldest first


def test_a_quota_counts_jobs_and_runs_together(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "gw.sqlite")
    quotas = Quotas(jobs=5, runs=5, samples=10, tokens=10**9, run_samples=10**6, streams=2)
    state.jobs.create(owner="me", request=JOB, cost=Cost(6, 0), quotas=quotas)
    with pytest.raises(QuotaExceeded):
        state.runs.create(owner="me", request=RUN, cost=Cost(6, 0), quotas=quotas)
    assert state.runs.with_status("queued") == []  # nothing stored
    state.runs.create(owner="you", request=RUN, cost=Cost(6, 0), quotas=quotas)  # another key's room


def test_a_job_is_settled_to_what_its_groups_produced_and_never_counted_twice(tmp_path: Path) -> None:
    """Charged its worst case at admission; when it ends (here: cancelled after two of its groups)
    its charge is what its stored groups produced, and a group stored again (a redelivered task, a
    resumed job) is counted once; the rest of the charge is free for the key's next job."""
    state = GatewayState(tmp_path / "gw.sqlite")
    quotas = Quotas(jobs=5, runs=5, samples=100, tokens=10**6, run_samples=10**6, streams=2)
    job_id, _ = state.jobs.create(owner="me", request=JOB, cost=Cost(60, 6000), quotas=quotas)
    with pytest.raises(QuotaExceeded) as refused:
        state.jobs.create(
            owner="me", request=JOB.model_copy(update={"job_key": "k2"}), cost=Cost(60, 1), quotas=quotas
        )
    assert refused.value.in_use == 60
    state.jobs.add_groups(job_id, [(0, {"index": 0}), (1, {"index": 1})], [Cost(7, 70), Cost(5, 50)])
    state.jobs.add_groups(job_id, [(1, {"index": 1})], [Cost(5, 50)])  # stored again: kept once
    assert state.jobs.produced(job_id) == Cost(12, 120)
    assert state.jobs.finish(job_id, "cancelled")
    row = state.jobs.get(job_id)
    assert row is not None and (row.samples, row.tokens) == (12, 120)
    assert not state.jobs.finish(job_id, "succeeded")  # no second settlement either
    job2 = JOB.model_copy(update={"job_key": "k2"})
    assert state.jobs.create(owner="me", request=job2, cost=Cost(99, 1), quotas=quotas)[1]


def test_start_and_finish_never_overwrite_a_cancel(tmp_path: Path) -> None:
    state = GatewayState(tmp_path / "gw.sqlite")
    job_id, _ = state.jobs.create(owner="me", request=JOB)
    run_id, _ = state.runs.create(owner="me", request=RUN)
    assert state.jobs.finish(job_id, "cancelled") and state.runs.finish(run_id, "cancelled")
    assert not state.jobs.start(job_id) and not state.runs.start(run_id)
    assert not state.runs.finish(run_id, "failed", error="late")
    assert state.cancelled_among([job_id, run_id, "job-x"]) == {job_id, run_id}
    assert state.runs.status(run_id) == "cancelled" and state.runs.get(run_id).error is None  # type: ignore[union-attr]
    # a failed run may be started again (its error cleared); a failed job is not
    job_id, _ = state.jobs.create(owner="me", request=JOB.model_copy(update={"job_key": "k2"}))
    run_id, _ = state.runs.create(owner="me", request=RUN)
    assert state.jobs.finish(job_id, "failed", error="x", counters={"a": 1.0})
    assert state.jobs.get(job_id).counters == {"a": 1.0}  # type: ignore[union-attr]
    assert state.runs.finish(run_id, "failed", error="x")
    assert not state.jobs.start(job_id) and state.runs.start(run_id)
    row = state.runs.get(run_id)
    assert row is not None and (row.status, row.error) == ("running", None)


def test_a_database_from_before_the_cost_columns_is_read(tmp_path: Path) -> None:
    path = tmp_path / "gw.sqlite"
    with sqlite3.connect(path) as db:  # the first release's tables, without samples and tokens
        db.executescript(
            "CREATE TABLE jobs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, job_key TEXT NOT NULL,"
            " status TEXT NOT NULL, request TEXT NOT NULL, n_prompts INTEGER NOT NULL, error TEXT,"
            " counters TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL, updated_at REAL NOT NULL,"
            " UNIQUE(owner, job_key));"
            "CREATE TABLE runs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, run_key TEXT, status TEXT NOT NULL,"
            " config TEXT NOT NULL, completed_steps INTEGER NOT NULL DEFAULT 0, total_steps INTEGER NOT NULL,"
            " policy_version INTEGER NOT NULL, batch_size INTEGER NOT NULL, error TEXT,"
            " created_at REAL NOT NULL, updated_at REAL NOT NULL, UNIQUE(owner, run_key));"
        )
        keyed = RUN.model_copy(update={"run_key": "r"})
        config = json.dumps(keyed.model_dump(mode="json"), sort_keys=True)
        db.execute(
            "INSERT INTO runs VALUES ('run-old', 'me', 'r', 'running', ?, 1, 3, 1, 8, NULL, 1.0, 2.0)",
            (config,),
        )
    state = GatewayState(path)
    row = state.runs.get("run-old")
    assert row is not None and (row.completed_steps, row.policy_version, row.samples, row.tokens) == (
        1,
        1,
        0,
        0,
    )
    assert state.runs.with_status("running") == ["run-old"]
    # the same request under its key is the stored run; a different one a conflict
    assert state.runs.create(owner="me", request=RUN.model_copy(update={"run_key": "r"})) == (
        "run-old",
        False,
    )


def test_the_lookahead_plans_up_to_staleness_steps_ahead_with_the_newest_version() -> None:
    planned: list[tuple[int, int, int]] = []

    async def generate(step: int, batch: int, version: int) -> Generated:
        planned.append((step, batch, version))
        await asyncio.sleep(3600)  # cancelled below
        raise AssertionError("never")

    async def scenario() -> None:
        ahead = LookAhead(generate, staleness=2)
        ahead.plan(Position(step=0, version=5, batch=8, total=4))
        ahead.plan(Position(step=0, version=5, batch=8, total=4))  # already planned: not again
        await asyncio.sleep(0)
        assert planned == [(0, 8, 5), (1, 8, 5), (2, 8, 5)]
        del ahead.tasks[0]  # step 0 done
        ahead.plan(Position(step=1, version=6, batch=4, total=4))  # only step 3 is new, at version 6
        await asyncio.sleep(0)
        assert planned[3:] == [(3, 4, 6)] and sorted(ahead.tasks) == [1, 2, 3]
        tasks = list(ahead.tasks.values())
        ahead.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert all(t.cancelled() for t in tasks)

    asyncio.run(scenario())
