"""Shared helpers of the gateway tests: API keys, in-process apps, gateway processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from gateway.keys import hash_key

REPO = Path(__file__).resolve().parents[2]
JOBS_KEY = "loom_test_jobs_key"
RUNS_KEY = "loom_test_runs_key"
ADMIN_KEY = "loom_test_admin_key"
API_KEYS = ",".join(
    [
        f"trainer:{hash_key(JOBS_KEY)}:jobs",
        f"runner:{hash_key(RUNS_KEY)}",
        f"ops:{hash_key(ADMIN_KEY)}:admin",
    ]
)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bind to port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class GatewayProcess:
    """``loom api gateway`` as a subprocess (killed with SIGKILL by ``kill``; always reaped)."""

    def __init__(self, env: dict[str, str], port: int, log_path: Path) -> None:
        self.env, self.port, self.log_path = env, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        argv = [
            sys.executable,
            "-m",
            "loom.cli",
            "api",
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not start:\n{self.log_path.read_text()[-4000:]}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def get(self, path: str, key: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, headers=auth(key), timeout=10.0, **kw)

    def post(self, path: str, key: str, body: Any) -> httpx.Response:
        return httpx.post(self.url + path, headers=auth(key), json=body, timeout=10.0)
