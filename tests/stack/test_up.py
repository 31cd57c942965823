"""``loom up`` / ``loom status`` / ``Stack`` as a user runs them: real processes, real brokers, free ports.

Each full stack is ten processes (plus Celery prefork children) on a small shared machine, so a test
reuses one stack for several assertions. Every test records the stack's process tree while it runs and
asserts that none of those processes outlives it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from launch.stack import Stack
from loom.contracts.settings import SERVICES

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT = 150.0
ADMIN_KEY = "loom_test-stack-admin-key"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with_ports(benv) -> dict[str, int]:  # type: ignore[no-untyped-def]
    ports = {svc: _free_port() for svc in SERVICES}
    for svc, port in ports.items():
        benv.extra_env[f"LOOM_{svc.upper()}_PORT"] = str(port)
    return ports


class UpProcess:
    """``loom up ARGS`` in the background; remembers every descendant it ever saw."""

    def __init__(self, benv, *args: str) -> None:  # type: ignore[no-untyped-def]
        self.out_path = benv.tmp / f"loom-up-{len(list(benv.tmp.glob('loom-up-*')))}.out"
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "up", *args],
                cwd=benv.tmp,
                env=benv.process_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.seen: dict[int, psutil.Process] = {}

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def sample(self) -> None:
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, text: str, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sample()
            if text in self.output():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"loom up exited ({self.proc.returncode}) before {text!r}:\n{self.output()}")
            time.sleep(0.2)
        pytest.fail(f"no {text!r} after {timeout} s:\n{self.output()}")

    def wait_exit(self, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.sample()
            time.sleep(0.2)
        return self.proc.wait(timeout=1)

    def survivors(self) -> list[psutil.Process]:
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=5)
        return [p for p in alive if _running(p)]

    def cleanup(self) -> None:
        """Test teardown: whatever happened, leave nothing running."""
        self.sample()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in self.seen.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.kill()
            except psutil.Error:
                pass


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def up(broker_env) -> Iterator:  # type: ignore[no-untyped-def]
    started: list[UpProcess] = []

    def start(*args: str) -> UpProcess:
        proc = UpProcess(broker_env, *args)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.cleanup()


def _status(benv, *args: str) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "launch.cli", "status", *args],
        cwd=benv.tmp,
        env=benv.process_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_up_smoke_brings_every_service_to_ready_and_round_trips_every_queue(broker_env, up) -> None:  # type: ignore[no-untyped-def]
    ports = _with_ports(broker_env)
    key_hash = hashlib.sha256(ADMIN_KEY.encode()).hexdigest()
    # a user's own keys: the stack adds its ephemeral key for the smoke ping next to them
    broker_env.extra_env["LOOM_API_KEYS"] = f"tester:{key_hash}:jobs+runs+admin"
    stack = up("--smoke")
    stack.wait_for("broker: ")  # the address table is printed once everything is ready
    out = stack.output()
    for svc, port in ports.items():
        assert f"ready   {svc}-api" in out and f"ready   {svc}-worker-1" in out, out
        assert f"http://127.0.0.1:{port}" in out, f"{svc} address not printed:\n{out}"
    code = stack.wait_exit(READY_TIMEOUT)
    out = stack.output()
    assert code == 0, out
    assert "loom up: smoke ok" in out
    result = json.loads(out[out.index("{") : out.rindex("}") + 1])
    assert result["ok"] is True
    assert sorted(result["queues"]) == sorted(SERVICES)
    for svc, answer in result["queues"].items():  # consumed by this stack's own workers
        assert answer["ok"] and answer["worker"]["service"] == svc
        assert answer["worker"]["pid"] in stack.seen, f"{svc} answered by a process outside the stack"
    assert len(stack.seen) >= 2 * len(SERVICES), "the stack's processes were not observed"
    assert stack.survivors() == []
    for svc in SERVICES:
        assert (broker_env.tmp / "loom-data" / "logs" / f"{svc}-api.log").stat().st_size > 0


@pytest.mark.parametrize("broker_env", ["rabbitmq"], indirect=True)
def test_status_of_a_running_stack_then_sigint_leaves_no_process(broker_env, up) -> None:  # type: ignore[no-untyped-def]
    ports = _with_ports(broker_env)
    stack = up("--only", "reward,learner")
    stack.wait_for("all ready")
    for svc in ("reward", "learner"):
        assert httpx.get(f"http://127.0.0.1:{ports[svc]}/readyz", timeout=5).status_code == 200, svc

    status = _status(broker_env, "--json", "--only", "reward,learner")
    assert status.returncode == 0, status.stdout + status.stderr
    report = json.loads(status.stdout)
    assert report["ready"] is True
    assert [(r["service"], r["healthz"], r["readyz"], r["queue_depth"]) for r in report["services"]] == [
        ("reward", "ok", "ready", 0),
        ("learner", "ok", "ready", 0),
    ]

    table = _status(broker_env)  # all five: three are not running
    assert table.returncode == 1
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["SERVICE", "URL", "HEALTHZ", "READYZ", "QUEUE"]
    rows = {line.split()[0]: line.split()[2:4] for line in lines[1:6]}
    assert rows == {
        "gateway": ["down", "down"],
        "rollout": ["down", "down"],
        "reward": ["ok", "ready"],
        "reflect": ["down", "down"],
        "learner": ["ok", "ready"],
    }, table.stdout

    stack.sample()
    assert len(stack.seen) >= 5  # 2 APIs, 2 workers, the learner's prefork child (reward: threads pool)
    stack.proc.send_signal(signal.SIGINT)
    assert stack.wait_exit() == 0, stack.output()
    assert "loom up: SIGINT, stopping" in stack.output()
    assert stack.survivors() == []


@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_crashed_worker_stops_the_stack_with_nonzero_exit(broker_env, up) -> None:  # type: ignore[no-untyped-def]
    _with_ports(broker_env)
    broker_env.extra_env["LOOM_REWARD_POOL"] = "prefork"  # a worker with a child to orphan
    stack = up("--only", "reward")
    stack.wait_for("all ready")
    worker = next(p for p in stack.seen.values() if "worker" in p.cmdline() and p.ppid() == stack.proc.pid)
    prefork_children = worker.children()
    assert prefork_children, "the Celery worker should run a prefork child"
    worker.kill()  # SIGKILL: its prefork child is orphaned, still in the worker's process group
    assert stack.wait_exit() == 1, stack.output()
    assert "reward-worker-1 exited unexpectedly (killed by signal 9)" in stack.output()
    assert stack.survivors() == []


@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_up_names_the_service_that_cannot_start_and_shows_its_log(broker_env, up) -> None:  # type: ignore[no-untyped-def]
    ports = _with_ports(broker_env)
    with socket.socket() as blocker:  # the reward API's port is taken
        blocker.bind(("127.0.0.1", ports["reward"]))
        blocker.listen()
        stack = up("--only", "reward", "--no-workers")
        assert stack.wait_exit() == 1
    out = stack.output()
    assert "reward-api exited unexpectedly" in out, out
    assert "last lines of reward-api's log" in out
    assert "address already in use" in out.lower(), out
    assert stack.survivors() == []


@pytest.mark.parametrize("broker_env", ["rabbitmq"], indirect=True)
def test_status_reports_services_that_are_down(broker_env) -> None:  # type: ignore[no-untyped-def]
    _with_ports(broker_env)
    r = _status(broker_env, "--json", "--only", "reward,learner")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert report["ready"] is False
    assert [(s["service"], s["healthz"], s["readyz"]) for s in report["services"]] == [
        ("reward", "down", "down"),
        ("learner", "down", "down"),
    ]
    assert report["broker_error"] is None  # RabbitMQ itself is up: depths are known (queues not declared)


@pytest.mark.parametrize("broker_env", ["rabbitmq"], indirect=True)
def test_stack_context_manager_round_trips_and_stops_its_processes(broker_env) -> None:  # type: ignore[no-untyped-def]
    _with_ports(broker_env)
    settings = broker_env.settings
    seen: list[psutil.Process] = []
    broker_env.extra_env["LOOM_REWARD_POOL"] = "prefork"  # its child must be stopped too
    with Stack(settings, services=("reward",), env=broker_env.process_env()) as stack:
        seen = [psutil.Process(pid) for pid in stack.pids()]
        assert len(seen) >= 3  # API, worker, the worker's prefork child
        result = stack.smoke(timeout=30)
        assert result["ok"] is True and result["queues"]["reward"]["worker"]["pid"] in stack.pids()
        assert stack.urls() == {"reward": settings.service_url("reward")}
    _, alive = psutil.wait_procs(seen, timeout=5)
    assert [p for p in alive if _running(p)] == []


def test_a_restarted_stack_keeps_the_previous_runs_logs(tmp_path: Path) -> None:
    """Issue 24: ``loom up`` truncated every log at start, so the log of a crash was lost to the
    restart after it. Now the last runs' logs stay as ``<proc>.log.1`` (newest) ... ``.N``."""
    from launch.stack import ProcSpec
    from loom.contracts.settings import Settings

    def run(n: int, **kw: int) -> None:
        line = f"run-{n}"
        spec = ProcSpec(
            "echo", [sys.executable, "-c", f"print({line!r}); import time; time.sleep(60)"], ready_log=line
        )
        with Stack(Settings(data_dir=tmp_path), services=(), extra=[spec], grace=2.0, **kw):
            pass

    logs = tmp_path / "logs"
    run(1)
    run(2)
    assert "run-2" in (logs / "echo.log").read_text() and "run-1" in (logs / "echo.log.1").read_text()
    from launch.stack import LOG_KEEP

    for n in range(3, 3 + LOG_KEEP + 2):
        run(n)
    last = 2 + LOG_KEEP + 2
    kept = sorted(p.name for p in logs.glob("echo.log*"))
    assert kept == ["echo.log", *[f"echo.log.{i}" for i in range(1, LOG_KEEP + 1)]]
    assert [(logs / f"echo.log.{i}").read_text().strip() for i in (1, LOG_KEEP)] == [
        f"run-{last - 1}",
        f"run-{last - LOG_KEEP}",
    ]
    run(last + 1, keep_logs=0)  # --keep-logs 0: the old behaviour, nothing rotated
    assert (logs / "echo.log.1").read_text().strip() == f"run-{last - 1}"
