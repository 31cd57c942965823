"""An unexpected error in a handler is a typed 500 that leaves the client's keep-alive connection open,
on a real uvicorn server (a raw socket sends two requests over one connection)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from loom.contracts.settings import Settings
from loom.service import create_app


@pytest.fixture
def server(tmp_path) -> Iterator[int]:  # type: ignore[no-untyped-def]
    app = create_app("reward", settings=Settings(data_dir=tmp_path))

    @app.get("/boom")
    async def boom() -> dict[str, str]:
        raise RuntimeError("a bug in a handler")

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    thread.join(10)


def _exchange(conn: socket.socket, path: str) -> tuple[int, bytes]:
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"server closed the connection before answering {path}")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(
        int(v)
        for k, v in (h.split(b":", 1) for h in head.split(b"\r\n")[1:])
        if k.lower() == b"content-length"
    )
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"server closed the connection mid-answer to {path}")
        body += chunk
    return int(head.split(b" ")[1]), body


def test_a_500_keeps_the_connection_for_the_next_request(server: int) -> None:
    with socket.create_connection(("127.0.0.1", server), timeout=10) as conn:
        for _ in range(3):
            status, body = _exchange(conn, "/boom")
            assert status == 500 and b'"error":"internal_error"' in body and b"reference" in body
            status, body = _exchange(conn, "/healthz")
            assert status == 200 and b'"status":"ok"' in body
