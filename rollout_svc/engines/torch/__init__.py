"""The torch engine: transformers in-process (CPU or GPU), Loom's reference implementation, split by
concern: ``engine`` (the ``TorchEngine`` facade), ``scheduler`` (the batching thread: admitting,
decoding and retiring rows), ``alone`` (one request decoded alone: group layouts,
``batching=False``), ``kv`` (the running batch's static KV cache), ``decode`` (its decode step,
eager or captured in CUDA graphs), ``prefix_cache`` (the prefix KV cache and its KV surgery), ``sampling``
(logits processors, temperature / top-k / top-p / min-p, log-probs, stops) and ``model`` (loading,
the teacher-forced reference pass, ``prompt_logprobs``). The modules import each other by their own
names, never through this package, which only re-exports (no import-order loop)."""

from rollout_svc.engines.torch.engine import TorchEngine
from rollout_svc.engines.torch.model import (
    block_mask,
    load_model,
    load_tokenizer,
    resolve_model_path,
    teacher_forced_logprobs,
)
from rollout_svc.engines.torch.sampling import has_logits_processors, process_logits

__all__ = [
    "TorchEngine",
    "block_mask",
    "has_logits_processors",
    "load_model",
    "load_tokenizer",
    "process_logits",
    "resolve_model_path",
    "teacher_forced_logprobs",
]
