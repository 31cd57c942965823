"""Servers the trainers' clients talk to: ``loom engine --model tiny`` and the rollout service (its
``/engine`` routes), each started as a real process on a free port, once per test session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    argv: list[str], health: str, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "LOOM_TORCH_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    proc = subprocess.Popen(
        [sys.executable, *[a.replace("{port}", str(port)) for a in argv]],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    stop(proc)
    raise RuntimeError(f"{argv} did not answer {health} in 180 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def loom_engine() -> Iterator[str]:
    """``loom engine --model tiny`` in vLLM's dev mode, as TRL's VLLMClient asks of a vLLM server
    (``/reset_prefix_cache`` and ``/server_info`` exist only there): the base URL."""
    argv = ["-m", "launch.cli", "engine", "--model", "tiny", "--port", "{port}"]
    proc, url = start(argv, "/health", {"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield url
    finally:
        stop(proc)


@pytest.fixture(scope="session")
def rollout_engine() -> Iterator[str]:
    """The rollout service on the tiny model (torch engine in its own process): its ``/engine`` URL."""
    argv = ["-m", "uvicorn", "rollout_svc.api:app", "--host", "127.0.0.1", "--port", "{port}"]
    proc, url = start(argv, "/healthz", {"LOOM_MODEL": "tiny", "LOOM_ENGINE": "torch", "LOOM_ENGINE_URL": ""})
    try:
        yield f"{url}/engine"
    finally:
        stop(proc)
