"""vLLM worker extension that lets Loom publish a full checkpoint to a running vLLM server.

Start vLLM 0.11.0 with ``--worker-extension-cls rollout_svc.engines.vllm_worker.LoomWorkerExtension``
and ``VLLM_SERVER_DEV_MODE=1``; the vllm engine client then calls ``POST /collective_rpc
{"method": "loom_reload_weights", "args": [<policy path>]}`` followed by ``POST /reset_prefix_cache``.
Runs inside vLLM's worker processes (``self.model_runner`` is vLLM's GPU model runner).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class LoomWorkerExtension:
    model_runner: Any

    def loom_reload_weights(self, path: str) -> int:
        """Load every ``*.safetensors`` tensor under ``path`` into the served model; returns the count."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no safetensors files under {path}")
        n = 0
        for f in files:
            weights = load_file(str(f), device="cpu")
            self.model_runner.model.load_weights(weights=weights.items())
            n += len(weights)
        return n
