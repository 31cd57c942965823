"""A live Loom deployment for the trainers' rollout client: the embedded broker, a real rollout worker
(torch engine, the built-in tiny model), a real reward worker and a gateway process, on free ports.
Started once per test module (``with LoomStack(tmp) as stack``); everything is killed at the end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from gateway.keys import hash_key
from tests.conftest import BrokerEnv, Worker, free_port, start_worker
from tests.gateway.helpers import GatewayProcess

TRAINER = "trainer"  # the key's name: the namespace it publishes policy versions into
TRAINER_KEY = "loom_test_rollouts_trainer_key"


class LoomStack:
    def __init__(self, tmp: Path, *, rollout_concurrency: int = 1, extra_env: dict[str, str] | None = None):
        data = tmp / "loom-data"
        env = {
            "LOOM_DATA_DIR": str(data),
            "LOOM_BROKER_URL": "embedded",
            "LOOM_RESULT_BACKEND": "embedded",
            "LOOM_EMBEDDED_VISIBILITY_TIMEOUT": "30",
            "LOOM_TORCH_THREADS": "1",
            "LOOM_DEVICE": "cpu",
            "LOOM_API_KEYS": f"{TRAINER}:{hash_key(TRAINER_KEY)}:jobs+policy",
        }
        self.benv = BrokerEnv(kind="embedded", tmp=tmp, env=env, extra_env=dict(extra_env or {}))
        self.rollout_concurrency = rollout_concurrency
        self.workers: list[Worker] = []
        self.gateway: GatewayProcess | None = None
        self.data_dir = data

    @property
    def url(self) -> str:
        assert self.gateway is not None
        return self.gateway.url

    @property
    def policy_root(self) -> Path:
        """The policy store the rollout workers read (LOOM_DATA_DIR/policy)."""
        return self.data_dir / "policy"

    def __enter__(self) -> LoomStack:
        try:
            self.workers = [
                start_worker(self.benv, "rollout", concurrency=self.rollout_concurrency, wait=False),
                start_worker(self.benv, "reward", wait=False),
            ]
            for w in self.workers:
                w.wait_ready(timeout=240)
            self.gateway = GatewayProcess(self.benv.process_env(), free_port(), self.benv.tmp / "gateway.log")
            self.gateway.start(timeout=120)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.kill()
        for w in self.workers:
            w.kill_group()
        self.benv.close()

    def restart_gateway(self) -> None:
        """SIGKILL the gateway and start it again on the same port and database (it resumes its jobs)."""
        assert self.gateway is not None
        self.gateway.kill()
        self.gateway = GatewayProcess(self.gateway.env, self.gateway.port, self.gateway.log_path)
        self.gateway.start(timeout=120)

    def job(self, job_id: str) -> dict[str, Any]:
        r = httpx.get(
            f"{self.url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {TRAINER_KEY}"}, timeout=30
        )
        r.raise_for_status()
        return dict(r.json())

    def logs(self) -> str:
        parts = [w.log()[-3000:] for w in self.workers]
        if self.gateway is not None and self.gateway.log_path.exists():
            parts.append(self.gateway.log_path.read_text(errors="replace")[-3000:])
        return "\n-----\n".join(parts)


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
