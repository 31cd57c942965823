"""Shared helpers of the gateway tests: API keys, in-process apps, gateway processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
            "launch.cli",
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


@contextmanager
def real_services(
    broker_env: Any,
    loom_worker: Callable[..., Any],
    tmp_path: Path,
    services: tuple[str, ...] = ("rollout", "reward", "learner"),
) -> Iterator[GatewayProcess]:
    """A started gateway process beside the REAL ``services`` workers (``loom worker``, the conftest's
    ``loom_worker`` fixture) on ``broker_env``, all ready; the gateway is killed at the end (the
    workers by their fixture)."""
    broker_env.extra_env.update(LOOM_API_KEYS=API_KEYS)
    workers = [loom_worker(s, broker_env, wait=False) for s in services]
    gw = GatewayProcess(broker_env.process_env(), free_port(), tmp_path / "gateway.log")
    try:
        gw.start()
        for w in workers:
            w.wait_ready()
        yield gw
    finally:
        gw.kill()


def wait_until(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> Any:
    """``pred()``'s first true value within ``timeout`` s (polled every ``every`` s); else an
    AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def start_run(gw: GatewayProcess, body: dict[str, Any]) -> str:
    """POST ``body`` as a new run (201); its id."""
    created = gw.post("/v1/runs", RUNS_KEY, body)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def wait_run_succeeded(gw: GatewayProcess, run_id: str, timeout: float) -> dict[str, Any]:
    """The run's view once it has ended, which must be ``succeeded`` (else the gateway's log tail)."""
    deadline = time.monotonic() + timeout
    while (view := gw.get(f"/v1/runs/{run_id}", RUNS_KEY).json())["status"] not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, f"timed out waiting for the run to finish: {view}"
        time.sleep(0.1)
    assert view["status"] == "succeeded", (view, gw.log_path.read_text()[-3000:])
    return dict(view)


def start_stage_workers(
    env: dict[str, str], namespace: str, tmp_path: Path, concurrency: int = 1
) -> list[subprocess.Popen[bytes]]:
    """A Celery worker of the SIMPLE STAGE TASKS (tests/gateway/stage_tasks.py) on the rollout and reward
    queues, ready when this returns; the caller kills its process group (``kill_group``)."""
    here = Path(__file__).parent
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(here)])}
    log_path = tmp_path / "worker-stages.log"
    argv = [sys.executable, "-m", "celery", "-A", "stage_tasks", "worker"]
    argv += ["-Q", f"{namespace}rollout,{namespace}reward", "-c", str(concurrency), "--pool", "prefork"]
    argv += ["-l", "INFO", "--without-gossip", "--without-mingle", "-n", f"stages-{free_port()}@%h"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, cwd=here, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    deadline = time.monotonic() + 60
    while " ready." not in log_path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            raise RuntimeError(f"stage worker did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    return [proc]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (a Celery worker and its pool children)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait(timeout=10)


def trained_steps(metrics: list[dict[str, Any]]) -> list[int]:
    """The steps of a run's per-step metrics (``GET /v1/runs/{id}/metrics``) that trained, after checking
    that the policy version moved by exactly one on each of them and not at all on a skipped one (a
    step whose groups all got one reward, or whose prompts were all dropped, trains nothing)."""
    trained: list[int] = []
    version = 0
    for m in metrics:
        skipped = m.get("learner/skipped", 0.0) == 1.0 or m.get("skipped_update", 0.0) == 1.0
        assert m["policy_version"] == version + (0 if skipped else 1), (m, metrics)
        if not skipped:
            trained.append(m["step"])
        version = m["policy_version"]
    return trained
