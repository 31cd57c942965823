"""The read deadlines of Loom's uvicorn protocol (loom/service.py) in the cases the gateway test does
not reach: a connection that sends nothing, the second request of a keep-alive connection, a body
still trickling after the app has answered, and a slow answer that must not be cut. On both of
uvicorn's HTTP implementations; a Loom app served by uvicorn in a thread of this process.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from loom.contracts.settings import Settings
from loom.service import ReadLimits, create_app, http_protocol
from tests.conftest import free_port

LIMITS = ReadLimits(header_timeout_s=1.0, body_timeout_s=1.0, body_min_rate=1000.0)
WAIT_S = 120.0  # generous: a loaded machine


def _app(tmp: str) -> FastAPI:
    app = create_app("deadlines", settings=Settings(data_dir=tmp))

    @app.get("/slow")
    async def slow() -> dict[str, bool]:
        await asyncio.sleep(3 * LIMITS.header_timeout_s)  # longer than every deadline, once read
        return {"ok": True}

    return app


@pytest.fixture(params=["httptools", "h11"])
def port(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        _app(str(tmp_path)),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=http_protocol(LIMITS, request.param),
        ws="none",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def _read_until_closed(sock: socket.socket, trickle: bytes = b"") -> bytes:
    """Everything the server sends until it closes, sending ``trickle`` a byte every 0.2 s meanwhile."""
    sock.settimeout(0.2)
    got = bytearray()
    sent = 0
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
            if not chunk:
                return bytes(got)
            got += chunk
        except TimeoutError:
            pass
        except ConnectionResetError:
            return bytes(got)
        if sent < len(trickle):
            try:
                sock.send(trickle[sent : sent + 1])
                sent += 1
            except OSError:
                return bytes(got)
    raise AssertionError(f"the server did not close the connection; got {bytes(got)[:200]!r}")


def _response(sock: socket.socket) -> bytes:
    """One complete response (headers and a Content-Length body) on a kept-alive connection."""
    sock.settimeout(WAIT_S)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(h.split(b":")[1] for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_connection_that_sends_nothing_is_answered_408_and_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        got = _read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in got, got


def test_a_kept_alive_connections_next_request_has_its_own_header_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert _response(sock).startswith(b"HTTP/1.1 200 ")
        got = _read_until_closed(sock, trickle=b"GET /healthz HTTP/1.1\r\nHost: t\r\nX-Pad: " + b"a" * 500)
    assert got.startswith(b"HTTP/1.1 408 "), got


def test_a_body_trickling_after_the_answer_is_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        # answered at once (405: /healthz takes no POST) while the declared body never completes
        sock.sendall(b"POST /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 100000\r\n\r\n")
        got = _read_until_closed(sock, trickle=b"a" * 5000)
    assert got.startswith(b"HTTP/1.1 405 "), got


def test_a_slow_answer_to_a_read_request_is_not_cut(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        answer = _response(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b'{"ok":true}'), answer
