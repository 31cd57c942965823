"""Slow clients are cut off (issue 35, finding 7): every Loom API started as ``loom api`` gives a
request's headers ``LOOM_HEADER_TIMEOUT_S`` and its body ``LOOM_BODY_TIMEOUT_S`` plus a second per
``LOOM_BODY_MIN_RATE`` bytes (loom/service.py). Before, six byte-a-time connections were all still
open after 65.7 s.

A real gateway process (``python -m launch.cli api gateway``, as compose and Kubernetes run it) on
each of uvicorn's HTTP implementations, 200 slow connections from this test (headers a byte at a
time, and bodies a byte at a time after complete headers), while normal requests keep being answered:
a quick one, a ping that waits longer than both deadlines, and a body sent slowly but above the
minimum rate. Every slow connection must be closed by the server; nothing here asserts a duration.
"""

from __future__ import annotations

import hashlib
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.slow

KEY = "loom_slow-clients-admin"
N_HEADERS = 100  # connections sending their headers a byte at a time
N_BODIES = 100  # connections sending complete headers, then their body a byte at a time
HEADER_TIMEOUT_S = 6.0
BODY_TIMEOUT_S = 6.0
BODY_MIN_RATE = 1000.0  # bytes/s; the trickle sends a few bytes/s per connection, the steady sender ~4000
TRICKLE_EVERY_S = 0.25
CLOSED_WITHIN_S = 180.0  # generous: a loaded 2-core machine


@pytest.fixture(scope="module", autouse=True)
def _enough_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


@pytest.fixture(params=["httptools", "h11"])
def gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``loom api gateway`` on ``request.param``'s HTTP implementation: (its URL, its log)."""
    port = free_port()
    env = {
        **os.environ,
        "LOOM_DATA_DIR": str(tmp_path / "data"),
        "LOOM_BROKER_URL": "embedded",
        "LOOM_RESULT_BACKEND": "embedded",
        "LOOM_GATEWAY_PORT": str(port),
        "LOOM_API_KEYS": f"tester:{hashlib.sha256(KEY.encode()).hexdigest()}:jobs+runs+admin",
        "LOOM_GATEWAY_BURST": "1000000",  # 100 requests of one key: the key's rate limit is not the subject
        "LOOM_GATEWAY_RUN_LOOP": "false",
        "LOOM_SERVICE_TOKEN": "",
        "LOOM_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "LOOM_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
        "LOOM_BODY_MIN_RATE": str(BODY_MIN_RATE),
        "LOOM_HTTP_PROTOCOL": request.param,
        "LOOM_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    log = tmp_path / "gateway.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "launch.cli", "api", "gateway"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@dataclass
class Slow:
    kind: str  # "headers" or "body"
    sock: socket.socket
    payload: bytes  # sent one byte per round, never to its end
    sent: int = 0
    got: bytearray = field(default_factory=bytearray)
    closed_by_server: bool = False


def _connect(port: int, kind: str, first: bytes, payload: bytes) -> Slow:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    if first:
        sock.sendall(first)
    sock.setblocking(False)
    return Slow(kind, sock, payload)


def _trickle(slow: list[Slow], stop: threading.Event) -> None:
    """One byte to every open connection per round; a connection the server closed (EOF, reset, or
    a refused send) is marked, and what it answered is kept."""
    selector = selectors.DefaultSelector()
    for s in slow:
        selector.register(s.sock, selectors.EVENT_READ, s)
    deadline = time.monotonic() + CLOSED_WITHIN_S + 60
    while not stop.is_set() and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=0):
            s = key.data
            try:
                data = s.sock.recv(65536)
            except OSError:
                data = b""
            if data:
                s.got += data
            else:
                s.closed_by_server = True
                selector.unregister(s.sock)
        for s in slow:
            if s.closed_by_server or s.sent >= len(s.payload):
                continue
            try:
                s.sock.send(s.payload[s.sent : s.sent + 1])
                s.sent += 1
            except BlockingIOError:
                pass
            except OSError:  # reset or broken pipe: the server closed it
                s.closed_by_server = True
                selector.unregister(s.sock)
        if all(s.closed_by_server for s in slow):
            break
        stop.wait(TRICKLE_EVERY_S)
    selector.close()


def _steady_body(port: int, result: dict[str, object]) -> None:
    """A JSON body of ~32 kB at ~4000 bytes/s: longer than BODY_TIMEOUT_S, faster than the minimum
    rate. It must be read and answered (422: not a job), not cut."""
    body = b'{"loom_not_a_job": "' + b"a" * 32_000 + b'"}'
    head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSED_WITHIN_S) as sock:
        sock.sendall(head)
        started = time.monotonic()
        for i in range(0, len(body), 64):
            sock.sendall(body[i : i + 64])
            time.sleep(0.016)
        result["seconds_sending"] = time.monotonic() - started
        answer = bytearray()
        while chunk := sock.recv(65536):
            answer += chunk
    result["answer"] = bytes(answer)


def test_slow_headers_and_bodies_are_cut_off_while_the_gateway_answers_others(
    gateway: tuple[str, Path],
) -> None:
    url, log = gateway
    port = int(url.rsplit(":", 1)[1])
    auth = {"Authorization": f"Bearer {KEY}"}
    headers_payload = b"GET /v1/runs/r-slow HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 4000
    body_head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer " + KEY.encode() + b"\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    slow = [_connect(port, "headers", b"", headers_payload) for _ in range(N_HEADERS)]
    slow += [_connect(port, "body", body_head, b'{"prompts": ["' + b"a" * 4000) for _ in range(N_BODIES)]
    stop = threading.Event()
    trickler = threading.Thread(target=_trickle, args=(slow, stop), daemon=True)
    trickler.start()
    steady: dict[str, object] = {}
    steady_thread = threading.Thread(target=_steady_body, args=(port, steady), daemon=True)
    steady_thread.start()
    try:
        # the others keep being answered while the slow ones are open
        open_at_answers = []
        with httpx.Client(timeout=CLOSED_WITHIN_S) as http:
            for _ in range(3):
                assert http.get(url + "/healthz").status_code == 200
                r = http.get(url + "/v1/runs/r-unknown", headers=auth)
                assert r.status_code == 404 and r.json()["error"] == "not_found", r.text
                open_at_answers.append(sum(not s.closed_by_server for s in slow))
            # a request that takes longer than both deadlines once read is not cut: the ping waits
            # its whole timeout for a worker (there is none) and answers 504 with every queue's result
            wait = HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 2
            r = http.post(url + "/v1/ping", json={"timeout": wait}, headers=auth)
            assert r.status_code == 504 and r.json()["ok"] is False, r.text
        assert max(open_at_answers) > 0, "the slow connections had all closed before the first answer"

        # every slow connection is closed by the server
        deadline = time.monotonic() + CLOSED_WITHIN_S
        while time.monotonic() < deadline and not all(s.closed_by_server for s in slow):
            time.sleep(0.5)
        still_open = [s.kind for s in slow if not s.closed_by_server]
        assert not still_open, f"{len(still_open)} slow connections still open: {set(still_open)}"
        # none of them sent its whole payload: the server, not the end of a request, closed them
        assert all(s.sent < len(s.payload) for s in slow)
        answered = [bytes(s.got) for s in slow if s.kind == "headers" and s.got]
        assert answered, "no slow-headers connection read the 408 before its close"
        assert all(a.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in a for a in answered)

        steady_thread.join(CLOSED_WITHIN_S)
        answer = steady.get("answer", b"")
        assert isinstance(answer, bytes) and answer.startswith(b"HTTP/1.1 422 "), (steady, answer[:300])
        assert float(steady["seconds_sending"]) > BODY_TIMEOUT_S  # type: ignore[arg-type]  # meaningful
        with httpx.Client(timeout=60) as http:
            assert http.get(url + "/healthz").status_code == 200
    finally:
        stop.set()
        trickler.join(30)
        for s in slow:
            s.sock.close()
    text = log.read_text(errors="replace")
    assert "unhandled error" not in text and "Traceback" not in text, text[-3000:]
