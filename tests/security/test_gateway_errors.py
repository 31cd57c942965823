"""The gateway's error answers (issue 24, item 6): a broker that is down is a 503 with Retry-After
(``GET /v1/queues`` was a 500), and every error body is ``{"error": <kind>, "detail": <text or
problems>, ...}`` with no ``detail.detail`` nesting (a 409 and a 404 were
``{"error": "conflict", "detail": {"error": "conflict", "detail": "..."}}``). In-process app."""

from __future__ import annotations

import sys
from pathlib import Path

from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import ADMIN_KEY, API_KEYS, JOBS_KEY, auth, free_port  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402


def _client(tmp_path: Path, broker_url: str = "embedded") -> TestClient:
    settings = Settings(
        data_dir=tmp_path, broker_url=broker_url, result_backend="embedded", api_keys=API_KEYS,
    )  # fmt: skip
    config = GatewaySettings(run_loop=False)
    return TestClient(build_app(settings, celery_app=make_celery("gateway", settings), config=config))


def test_queues_with_the_broker_down_is_503_with_retry_after(tmp_path: Path) -> None:
    closed = free_port()  # nothing listens there: the broker is down
    with _client(tmp_path, f"amqp://guest:guest@127.0.0.1:{closed}//") as c:
        r = c.get("/v1/queues", headers=auth(ADMIN_KEY))
        assert r.status_code == 503, r.text
        assert r.json() == {"error": "dependency_unavailable", "detail": "the broker is unreachable"}
        assert int(r.headers["Retry-After"]) >= 1
        assert str(closed) not in r.text  # no address of the inside leaks out
        assert c.get("/readyz").status_code == 503  # and the probe says so too


def test_error_bodies_are_flat(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        job = {"job_key": "k", "prompts": ["p"]}
        assert c.post("/v1/jobs", json=job, headers=auth(JOBS_KEY)).status_code == 201
        answers = {
            "conflict": c.post("/v1/jobs", json={**job, "prompts": ["q"]}, headers=auth(JOBS_KEY)),
            "not_found": c.get("/v1/jobs/job-nosuch", headers=auth(JOBS_KEY)),
            "not_found_run": c.post("/v1/runs/run-nosuch/cancel", headers=auth(ADMIN_KEY)),
            "no_route": c.get("/v1/nowhere", headers=auth(JOBS_KEY)),
            "invalid_dataset": c.post("/v1/runs", json={"dataset": {"jsonl": "{}"}}, headers=auth(ADMIN_KEY)),
            "unauthenticated": c.get("/v1/jobs/x", headers=auth("loom_wrong")),
            "forbidden": c.get("/v1/queues", headers=auth(JOBS_KEY)),
        }
        expected = {
            "conflict": (409, "conflict"),
            "not_found": (404, "not_found"),
            "not_found_run": (404, "not_found"),
            "no_route": (404, "not_found"),
            "invalid_dataset": (422, "invalid_dataset"),
            "unauthenticated": (401, "unauthenticated"),
            "forbidden": (403, "forbidden"),
        }
        for name, r in answers.items():
            body = r.json()
            assert (r.status_code, body["error"]) == expected[name], (name, r.text)
            assert isinstance(body["detail"], str) and body["detail"], (name, r.text)  # never nested
