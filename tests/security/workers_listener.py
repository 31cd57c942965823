"""A real TCP server for the worker security tests: it records every connection it accepts (and the
HTTP requests it reads), and answers in one of a few fixed ways. Not a stand-in for a Loom component:
it plays the endpoint a hostile user would point a worker at, or an operator's scorer that misbehaves.

Behaviours:
- ``secret``: answers every request ``200`` with a JSON body holding ``SECRET`` and no ``scores``;
- ``error``: answers ``500`` with ``SECRET`` in the body;
- ``silent``: accepts and reads, never answers (the connection stays open until ``close``);
- ``scores``: answers a scorer's request with valid scores (one per step) after ``delay`` seconds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

SECRET = "internal-admin-secret-4f1c"


class Listener:
    def __init__(self, behaviour: str = "secret", delay: float = 0.0) -> None:
        self.behaviour, self.delay = behaviour, delay
        self.connections = 0
        self.requests: list[dict[str, Any]] = []  # {"line", "headers", "body"} per request read
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket) -> dict[str, Any] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
        size = int(headers.get("content-length", "0"))
        while len(body) < size:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
        request = {"line": lines[0], "headers": headers, "body": body[:size]}
        with self._lock:
            self.requests.append(request)
        return request

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stop.is_set():
                request = self._read_request(conn)
                if request is None:
                    return
                if self.behaviour == "silent":
                    self._stop.wait()  # hold the connection, answer nothing
                    return
                if self.behaviour == "scores":
                    time.sleep(self.delay)
                    steps = json.loads(request["body"])["steps"]
                    status, body = 200, {"scores": [0.5] * len(steps), "policy_version": 0}
                elif self.behaviour == "error":
                    status, body = 500, {"error": SECRET}
                else:
                    status, body = 200, {"secret": SECRET}
                payload = json.dumps(body).encode()
                conn.sendall(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
        except OSError:
            return
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        with self._lock:
            for c in self._open:
                try:
                    c.close()
                except OSError:
                    pass

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
