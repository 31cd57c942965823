"""Large datasets are streamed, not parsed inside the request handler (issue 24, item 5): a 150k-line
JSONL dataset is uploaded as a chunked stream (``POST /v1/datasets``), checked line by line as it comes
and stored on disk; a run names it by id, its stored config holds the id (not 150k lines) and the run
loop reads each step's rows from the file. A bad line is a 422 naming it, and nothing is stored.
Before, there was no upload route and a run's inline JSONL was parsed whole in the handler into
150k items (7.45 s, gateway RSS 422 MB in the issue's probe) and kept in the run's config.

Issue 35 (findings 2 and 3): a jobs-only key stored datasets without limit, and any key's run could
name any dataset id (ids are content hashes: an oracle for "does this content exist", and a leaked id
read another key's rows). Now uploads need the ``runs`` scope, a key's stored datasets are bounded by
its dataset quota (an upload past it stops as soon as its bytes pass it, and nothing is stored), and
a dataset belongs to the keys that stored it: another key's id is answered as an unknown one."""

from __future__ import annotations

import json
import os
import select
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from helpers import API_KEYS, JOBS_KEY, RUNS_KEY, GatewayProcess, auth, free_port  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from gateway.keys import hash_key  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402

LINES = 150_000
OTHER_KEY = "loom_test_other_runs_key"  # a second jobs+runs key, as in the probe
KEYS = f"{API_KEYS},other:{hash_key(OTHER_KEY)}"


def _client(tmp_path: Path, **config: object) -> TestClient:
    """A gateway on ``tmp_path``; ``config``: its GatewaySettings besides run_loop=False."""
    settings = Settings(data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=KEYS)
    gateway = GatewaySettings(**{"run_loop": False, **config})  # type: ignore[arg-type]
    return TestClient(build_app(settings, celery_app=make_celery("gateway", settings), config=gateway))


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


def _upload(c: TestClient, body: Iterator[bytes] | bytes, key: str = RUNS_KEY):  # type: ignore[no-untyped-def]
    headers = {**auth(key), "content-type": "application/x-ndjson"}
    return c.post("/v1/datasets", content=body, headers=headers)


def _rows(tag: str, n: int = 1000) -> bytes:
    return "".join(
        json.dumps({"prompt": f"{tag} {i} + 1?", "answer": i + 1}) + "\n" for i in range(n)
    ).encode()


def _stored(tmp_path: Path) -> list[str]:
    """The files of the datasets folder (stored datasets and any upload's leftovers)."""
    root = tmp_path / "datasets"
    return sorted(os.listdir(root)) if root.exists() else []


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
        config = json.dumps(state.runs.get(r.json()["id"]).config)
        assert len(config) < 4096 and info["id"] in config  # the id, not 150k lines

        loop = RunLoop(r.json()["id"], state, None, tmp_path)  # type: ignore[arg-type]
        assert len(loop.dataset) == LINES and not isinstance(loop.dataset, list)
        item = loop.dataset[122_999]
        assert (item.prompt, item.label, item.task) == ("What is 123000 + 1?", "123001", "arithmetic")

        # a run's inline JSONL is stored the same way: its config keeps the id
        inline = {"dataset": {"jsonl": '{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n'}}
        r = c.post("/v1/runs", json={**inline, "run_key": "inline"}, headers=auth(RUNS_KEY))
        assert r.status_code == 201, r.text
        config = state.runs.get(r.json()["id"]).config
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
    with _client(tmp_path, dataset_max_bytes=100_000) as c:
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


def test_a_jobs_only_key_cannot_store_or_delete_datasets(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        r = _upload(c, _rows("jobs"), key=JOBS_KEY)
        assert r.status_code == 403 and r.json()["error"] == "forbidden", r.text
        assert "'runs' scope" in r.json()["detail"] and _stored(tmp_path) == []
        r = c.delete("/v1/datasets/ds-" + "0" * 24, headers=auth(JOBS_KEY))
        assert r.status_code == 403
        assert _upload(c, _rows("jobs"), key=RUNS_KEY).status_code == 201  # a runs key may


def test_the_dataset_quota_refuses_an_upload_past_it_and_stores_nothing(tmp_path: Path) -> None:
    with _client(tmp_path, quota_dataset_bytes=200_000, quota_datasets=2) as c:
        state = c.app.state.gateway_state  # type: ignore[attr-defined]
        r = _upload(c, _jsonl())  # 150k lines, 4.6 MB
        assert r.status_code == 413, r.text
        body = r.json()
        assert body["error"] == "quota_exceeded" and body["quota"] == "dataset_bytes"
        assert (body["limit"], body["in_use"]) == (200_000, 0) and body["requested"] > 200_000
        assert "LOOM_GATEWAY_QUOTA_DATASET_BYTES" in body["detail"]
        assert _stored(tmp_path) == [] and state.datasets.usage("runner") == (0, 0)

        first = _upload(c, _rows("a"))
        assert first.status_code == 201, first.text
        held = state.datasets.usage("runner")
        assert held == (len(_rows("a")), 1)
        again = _upload(c, _rows("a"))  # the same content again: the same dataset, charged once
        assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
        assert state.datasets.usage("runner") == held

        # past the bytes left beside what the key stores: in_use says what it stores
        r = _upload(c, _rows("big", 5000))
        assert r.status_code == 413 and (r.json()["quota"], r.json()["in_use"]) == ("dataset_bytes", held[0])
        assert _upload(c, _rows("b")).status_code == 201
        r = _upload(c, _rows("c"))  # a third dataset: over the count
        assert r.status_code == 413 and r.json()["quota"] == "datasets" and r.json()["in_use"] == 2, r.text
        # a run's inline JSONL is stored for its key too, under the same quota
        inline = {"dataset": {"jsonl": _rows("c").decode()}}
        r = c.post("/v1/runs", json=inline, headers=auth(RUNS_KEY))
        assert r.status_code == 413 and r.json()["quota"] == "datasets", r.text
        assert len(_stored(tmp_path)) == 4  # two datasets, each a data file and an index

        # deleting one frees its bytes and its place; an id the key no longer stores is a 404
        assert c.delete(f"/v1/datasets/{first.json()['id']}", headers=auth(RUNS_KEY)).status_code == 204
        assert c.delete(f"/v1/datasets/{first.json()['id']}", headers=auth(RUNS_KEY)).status_code == 404
        assert len(_stored(tmp_path)) == 2
        assert c.post("/v1/runs", json=inline, headers=auth(RUNS_KEY)).status_code == 201


def test_a_run_names_only_its_own_keys_datasets(tmp_path: Path) -> None:
    """Key B naming key A's dataset id gets exactly the answer of a never-uploaded id; B uploading the
    same content gets its own (the same id, its own ownership); the files go with the last owner."""
    with _client(tmp_path) as c:
        mine = _upload(c, _rows("secret")).json()["id"]
        never = "ds-" + "0" * 24

        def run(key: str, dataset_id: str):  # type: ignore[no-untyped-def]
            return c.post("/v1/runs", json={"dataset": {"id": dataset_id}}, headers=auth(key))

        theirs, unknown = run(OTHER_KEY, mine), run(OTHER_KEY, never)
        assert theirs.status_code == unknown.status_code == 422
        assert theirs.json() == json.loads(unknown.text.replace(never, mine)), (theirs.text, unknown.text)
        gone, nothing = (c.delete(f"/v1/datasets/{i}", headers=auth(OTHER_KEY)) for i in (mine, never))
        assert gone.status_code == nothing.status_code == 404
        assert gone.json() == json.loads(nothing.text.replace(never, mine))

        same = _upload(c, _rows("secret"), key=OTHER_KEY)  # the other key stores the same content
        assert same.status_code == 201 and same.json()["id"] == mine
        theirs = run(OTHER_KEY, mine)
        assert theirs.status_code == 201, theirs.text
        queued = run(RUNS_KEY, mine)
        assert queued.status_code == 201, queued.text
        r = c.delete(f"/v1/datasets/{mine}", headers=auth(RUNS_KEY))  # its queued run reads it
        assert r.status_code == 409 and r.json()["error"] == "conflict", r.text
        assert c.post(f"/v1/runs/{queued.json()['id']}/cancel", headers=auth(RUNS_KEY)).status_code == 200
        assert c.delete(f"/v1/datasets/{mine}", headers=auth(RUNS_KEY)).status_code == 204
        assert f"{mine}.jsonl" in _stored(tmp_path)  # the other key still stores it
        assert run(RUNS_KEY, mine).status_code == 422 and run(OTHER_KEY, mine).status_code == 201
        for run_id in c.app.state.gateway_state.runs.with_status("queued"):  # type: ignore[attr-defined]
            c.post(f"/v1/runs/{run_id}/cancel", headers=auth(OTHER_KEY))
        assert c.delete(f"/v1/datasets/{mine}", headers=auth(OTHER_KEY)).status_code == 204
        assert _stored(tmp_path) == []


def test_an_upload_past_the_quota_stops_while_it_streams(tmp_path: Path) -> None:
    """Through a real gateway process (uvicorn reads the body as it comes): the upload is refused as
    soon as its bytes pass the quota, long before the client has sent it all, and nothing is stored."""
    quota, chunk, chunks = 300_000, 64 * 1024, 1024  # a 64 MiB upload against a 300 kB quota
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(
        LOOM_DATA_DIR=str(tmp_path / "data"), LOOM_BROKER_URL="embedded", LOOM_RESULT_BACKEND="embedded",
        LOOM_API_KEYS=KEYS, LOOM_GATEWAY_RUN_LOOP="false", LOOM_TORCH_THREADS="1",
        LOOM_GATEWAY_QUOTA_DATASET_BYTES=str(quota), LOOM_GATEWAY_DATASET_MAX_BYTES=str(chunk * chunks * 2),
    )  # fmt: skip
    gw = GatewayProcess(env, free_port(), tmp_path / "gateway.log")
    line = json.dumps({"prompt": "What is 1 + 1?", "answer": 2}) + "\n"
    data = (line * (chunk // len(line) + 1)).encode()[:chunk]
    data = data[: data.rfind(b"\n") + 1]
    try:
        gw.start()
        with socket.create_connection(("127.0.0.1", gw.port), timeout=60) as s:
            s.sendall(
                b"POST /v1/datasets HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer "
                + RUNS_KEY.encode()
                + b"\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            s.setblocking(False)
            pending, sent, answer = b"", 0, b""
            while b"\r\n\r\n" not in answer:
                if not pending and sent < chunks:
                    pending, sent = b"%x\r\n" % len(data) + data + b"\r\n", sent + 1
                readable, writable, _ = select.select([s], [s] if pending else [], [], 60)
                assert readable or writable, "no answer and no room to send for 60 s"
                if readable:
                    got = s.recv(65536)
                    assert got, "the gateway closed the connection without an answer"
                    answer += got
                elif writable:
                    pending = pending[s.send(pending) :]
            head, _, rest = answer.partition(b"\r\n\r\n")
            s.setblocking(True)
            length = int(
                next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
            )
            while len(rest) < length:
                rest += s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413"), head
        body = json.loads(rest[:length])
        assert body["error"] == "quota_exceeded" and body["quota"] == "dataset_bytes"
        # refused at the first chunk past the quota, not at the end of the 64 MiB
        assert quota < body["requested"] <= quota + 4 * chunk, body
        assert sent < chunks // 2, sent
        stored = tmp_path / "data" / "datasets"
        assert not stored.exists() or os.listdir(stored) == []
    finally:
        gw.kill()
