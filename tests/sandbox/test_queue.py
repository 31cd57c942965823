"""The sandbox queue: ``loom worker sandbox`` (a real Celery worker process on each broker) runs a
``sandbox.run_batch`` published through the task table; a hostile run in the batch fails nothing; a
``sandbox.run_cells`` keeps its variables from cell to cell in one session."""

from __future__ import annotations

import pytest

from loom.contracts.sandbox import (
    BatchRequest,
    BatchResult,
    CellsRequest,
    CellsResult,
    Limits,
    RunRequest,
    SessionCall,
)
from loom.contracts.tasks import SANDBOX_RUN_BATCH, SANDBOX_RUN_CELLS
from loom.queue import send
from sandbox_svc.runner import bwrap_path

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed (deploy/setup.sh)")


def test_a_batch_over_the_sandbox_queue(broker_env, loom_worker) -> None:  # type: ignore[no-untyped-def]
    broker_env.extra_env["LOOM_SERVICE_TOKEN"] = "queue-test-token-91c"
    loom_worker("sandbox", broker_env, concurrency=2)
    app = broker_env.app("sandbox")
    lim = Limits(cpu_s=1, wall_s=3)
    batch = BatchRequest(
        runs=[
            RunRequest(code="import os\nprint(sorted(os.environ))", limits=lim),
            RunRequest(code="while True: pass", limits=lim),
            RunRequest(language="bash", code="read x; echo $((x+1))", stdin="41\n", limits=lim),
        ]
    )
    out = BatchResult.model_validate(send(app, SANDBOX_RUN_BATCH, batch).get(timeout=120))
    assert [r.status for r in out.results] == ["ok", "timeout", "ok"]
    assert "LOOM" not in out.results[0].stdout and out.results[2].stdout == "42\n"


def test_cells_in_one_session_over_the_sandbox_queue(broker_env, loom_worker) -> None:  # type: ignore[no-untyped-def]
    broker_env.extra_env["LOOM_SERVICE_TOKEN"] = "queue-test-token-91c"
    loom_worker("sandbox", broker_env, concurrency=2)
    app = broker_env.app("sandbox")
    req = CellsRequest(
        cells=[
            SessionCall(code="import os\nacc = [1]"),
            SessionCall(code="acc.append(2)\nprint(acc, 'LOOM' in str(dict(os.environ)))"),
            SessionCall(code="while True: pass"),
            SessionCall(code="acc"),
        ],
        limits=Limits(cpu_s=1, wall_s=5),
    )
    out = CellsResult.model_validate(send(app, SANDBOX_RUN_CELLS, req).get(timeout=120))
    assert [r.status for r in out.results] == ["ok", "ok", "timeout", "session_lost"], out
    assert out.results[1].stdout == "[1, 2] False\n" and out.results[2].session.ended == "timeout"
