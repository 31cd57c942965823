"""vLLM worker extension: Loom's full-checkpoint policy update, run inside vLLM's worker processes.

vLLM imports this module by name (``--worker-extension-cls
rollout_svc.engines.vllm_worker.LoomWorkerExtension``) with its own Python, so it may import only the
standard library and what vLLM's environment has (torch); it must not import Loom's other modules.
Whoever starts vLLM puts the repository on ``PYTHONPATH`` (docs/vllm.md).

``loom_reload_weights(weights_path)`` (``POST /collective_rpc``, dev mode) is one policy update:
1. check the checkpoint before touching the model: every ``*.safetensors`` file complete, the same
   tensor names and shapes as the checkpoint now served (a bad path or a different model is refused
   here, and the served weights are not changed);
2. vLLM's own ``reload_weights(weights_path=...)`` (layer-wise reload, which re-runs the CPU
   backend's weight repacking);
3. re-tie a tied ``lm_head`` to the new embeddings and repack it: the reload skips ``lm_head.weight``
   of a tied checkpoint and leaves the head's packed copy at the OLD embeddings (measured on the CPU
   backend: max |Δ log-prob| 0.44 without this, 5.7e-6 with it);
4. if 2-3 raise, reload the previous checkpoint the same way, so the server never serves a half-loaded
   model.
It answers a JSON object, ``{"loaded": true, ...}`` or ``{"loaded": false, "error": ...}``; the client
(``rollout_svc.engines.vllm``) turns ``loaded: false`` into ``PolicyLoadError``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

RELOAD_METHOD = "loom_reload_weights"


def safetensors_manifest(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every ``*.safetensors`` file in directory ``path``, read from the file
    headers only. ValueError for no such directory, no safetensors file, or a truncated/corrupt file."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{path} is not a directory")
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path}")
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        size = f.stat().st_size
        with f.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{f.name} is not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"{f.name} is not a safetensors file (header length {n} > file)")
            try:
                header = json.loads(fh.read(n))
            except ValueError as exc:
                raise ValueError(f"{f.name} has a corrupt header: {exc}") from exc
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            out[name] = tuple(int(d) for d in info["shape"])
            end = max(end, int(info["data_offsets"][1]))
        if 8 + n + end != size:
            raise ValueError(f"{f.name} is truncated or padded: {size} bytes, its header says {8 + n + end}")
    return out


def checkpoint_problem(new: str, current: str) -> str | None:
    """Why checkpoint ``new`` cannot replace ``current`` in place (None: it can). Both are directories
    in Loom's use; when ``current`` is not a local directory (a hub name) only ``new`` is checked."""
    try:
        wanted = safetensors_manifest(new)
    except (OSError, ValueError) as exc:
        return f"cannot load {new}: {exc}"
    if not Path(current).is_dir():
        return None
    try:
        served = safetensors_manifest(current)
    except (OSError, ValueError):
        return None  # the served checkpoint is gone from disk: nothing to compare against
    missing = sorted(set(served) - set(wanted))
    extra = sorted(set(wanted) - set(served))
    if missing or extra:
        return (
            f"{new} does not hold the served model's tensors (missing {missing[:5]}, unexpected {extra[:5]})"
        )
    shapes = [k for k in served if served[k] != wanted[k]]
    if shapes:
        k = shapes[0]
        return f"{new}: tensor {k} has shape {list(wanted[k])}, the served model's is {list(served[k])}"
    return None


def _unwrap(module: Any) -> Any:
    return getattr(module, "base_layer", module)  # a LoRA wrapper keeps the real layer here


def tie_lm_head(model: Any, hf_config: Any) -> bool:
    """Point a tied ``lm_head`` at the embeddings again and redo its post-load processing (the CPU
    backend's GEMM repacking; nothing on CUDA). Returns whether the model ties its head."""
    if not getattr(hf_config, "tie_word_embeddings", False):
        return False
    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is None or embed is None:
        return False
    head, embed = _unwrap(head), _unwrap(embed)
    head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


class LoomWorkerExtension:
    """Mixed into vLLM's worker class, whose attributes it uses (vLLM refuses an extension that
    defines a name the worker has, so every name here starts with ``loom_`` or ``_loom_``)."""

    vllm_config: Any
    model_runner: Any

    def _loom_load(self, weights_path: str) -> bool:
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]  # vLLM's Worker
        model_config = self.vllm_config.model_config
        return tie_lm_head(self.model_runner.get_model(), model_config.hf_text_config)

    def loom_reload_weights(self, weights_path: str) -> dict[str, Any]:
        current = str(self.vllm_config.model_config.model)
        if not isinstance(weights_path, str) or not weights_path:
            return {"loaded": False, "error": f"weights_path must be a path, got {weights_path!r}"}
        problem = checkpoint_problem(weights_path, current)
        if problem is not None:
            return {"loaded": False, "error": problem, "weights_path": current}
        try:
            tied = self._loom_load(weights_path)
        except Exception as exc:  # noqa: BLE001 - any loader failure: put the served weights back
            error = f"reloading {weights_path} failed: {type(exc).__name__}: {exc}"
            try:
                self._loom_load(current)
            except Exception as again:  # noqa: BLE001
                return {"loaded": False, "error": error, "rolled_back": False, "rollback_error": repr(again)}
            return {"loaded": False, "error": error, "rolled_back": True, "weights_path": current}
        return {"loaded": True, "weights_path": weights_path, "tied_lm_head": tied}

    def loom_weights_path(self) -> str:
        """The checkpoint the worker serves now (vLLM's ``model_config.model``, moved by reloads)."""
        return str(self.vllm_config.model_config.model)
