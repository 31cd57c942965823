"""Large datasets are streamed, not parsed inside the request handler (issue 24, item 5): a 150k-line
JSONL dataset is uploaded as a chunked stream (``POST /v1/datasets``), checked line by line as it comes
and stored on disk; a run names it by id, its stored config holds the id (not 150k lines) and the run
loop reads each step's rows from the file. A bad line is a 422 naming it, and nothing is stored.
Before, there was no upload route and a run's inline JSONL was parsed whole in the handler into
150k items (7.45 s, gateway RSS 422 MB in the issue's probe) and kept in the run's config."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, RUNS_KEY, auth  # noqa: E402

from gateway.api import build_app  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402

LINES = 150_000


def _client(tmp_path: Path, **overrides: object) -> TestClient:
    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS,
        gateway_run_loop=False, **overrides,  # type: ignore[arg-type]
    )  # fmt: skip
    return TestClient(build_app(settings, celery_app=make_celery("gateway", settings)))


def _jsonl(bad_at: int | None = None) -> Iterator[bytes]:
    """The dataset in 64 KiB chunks (a generator body: sent chunked, without a Content-Length)."""
    buf = []
    for i in range(1, LINES + 1):
        row = (
            '{"prompt": "x"' if i == bad_at else json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1})
        )
        buf.append(row + "\n")
        if len(buf) == 2000:
            data = "".join(buf).encode()
            for k in range(0, len(data), 65536):
                yield data[k : k + 65536]
            buf = []
    yield "".join(buf).encode()


def _upload(c: TestClient, body: Iterator[bytes]):  # type: ignore[no-untyped-def]
    headers = {**auth(RUNS_KEY), "content-type": "application/x-ndjson"}
    return c.post("/v1/datasets", content=body, headers=headers)


def test_a_150k_line_dataset_is_streamed_to_disk_and_read_by_the_run_row_by_row(tmp_path: Path) -> None:
    from gateway.runs import RunLoop

    with _client(tmp_path) as c:
        r = _upload(c, _jsonl())
        assert "content-length" not in {k.lower() for k in r.request.headers}  # it was streamed
        assert r.status_code == 201, r.text
        info = r.json()
        assert info["n_items"] == LINES and info["id"].startswith("ds-")
        assert _upload(c, _jsonl()).json()["id"] == info["id"]  # the same content is the same dataset

        run = {"dataset": {"id": info["id"], "task": "arithmetic"}, "schedule": {"steps": 2, "batch_size": 4}}
        r = c.post("/v1/runs", json=run, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text
        state = c.app.state.gateway_state  # type: ignore[attr-defined]
        config = state.run(r.json()["id"])["config"]
        assert len(config) < 4096 and info["id"] in config  # the id, not 150k lines

        loop = RunLoop(r.json()["id"], state, None, tmp_path)  # type: ignore[arg-type]
        assert len(loop.dataset) == LINES and not isinstance(loop.dataset, list)
        item = loop.dataset[122_999]
        assert (item.prompt, item.label, item.task) == ("What is 123000 + 1?", "123001", "arithmetic")

        # a run's inline JSONL is stored the same way: its config keeps the id
        inline = {"dataset": {"jsonl": '{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n'}}
        r = c.post("/v1/runs", json={**inline, "run_key": "inline"}, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text
        config = json.loads(state.run(r.json()["id"])["config"])
        assert config["dataset"]["jsonl"] is None and config["dataset"]["id"].startswith("ds-")
        again = c.post("/v1/runs", json={**inline, "run_key": "inline"}, headers=auth(RUNS_KEY))
        assert again.status_code == 200 and again.json()["id"] == r.json()["id"]  # still idempotent


def test_a_bad_line_is_422_naming_it_and_nothing_is_stored(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        r = _upload(c, _jsonl(bad_at=100_000))
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "invalid_dataset" and "jsonl line 100000" in r.json()["detail"]
        assert list((tmp_path / "datasets").iterdir()) == []
        r = c.post("/v1/runs", json={"dataset": {"id": "ds-" + "0" * 24}}, headers=auth(RUNS_KEY))
        assert r.status_code == 422 and "no dataset" in r.json()["detail"]


def test_a_dataset_over_its_limit_is_413(tmp_path: Path) -> None:
    with _client(tmp_path, gateway_dataset_max_bytes=100_000) as c:
        r = _upload(c, _jsonl())
        assert r.status_code == 413 and r.json()["error"] == "payload_too_large", r.text


def test_the_gateway_client_streams_rows_and_cancels_jobs(tmp_path: Path) -> None:
    from loom.clients.gateway import GatewayClient

    with _client(tmp_path) as c:
        c.headers.update(auth(RUNS_KEY))
        gc = GatewayClient("http://testserver")
        gc.http = c  # TestClient is an httpx.Client: the typed client drives the in-process app
        rows = ({"prompt": f"What is {i} + 1?", "answer": i + 1} for i in range(5000))  # read lazily
        info = gc.upload_dataset(rows, chunk_rows=700)
        assert info["n_items"] == 5000 and info["id"].startswith("ds-")
        job = gc.submit_job({"job_key": "client", "prompts": ["p"]})
        assert gc.cancel_job(job)["status"] == "cancelled" and gc.job(job)["status"] == "cancelled"
