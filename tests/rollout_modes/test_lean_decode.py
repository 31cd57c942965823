"""The lean decode step (rollout_svc/engines/torch/lean.py) against the model's own forward: random-
weight checkpoints of the families it takes, over the engine's static KV cache, rows of different
lengths (a padded-row mask) and equal ones (no mask), float32 and bfloat16: the same logits and the
same cache writes to the bit; the families it does not take get None (the full forward runs); the
engine runs its decode steps through it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from loom.architectures import attention_of
from loom.contracts.wire import SamplingParams
from rollout_svc.engines.torch.decode import DecodeStep
from rollout_svc.engines.torch.kv import StaticKv
from rollout_svc.engines.torch.lean import lean_step
from tests.test_architectures import COMMON as ARCH_COMMON

COMMON = {**ARCH_COMMON, "vocab_size": 97}


def model_of(name: str, dtype: torch.dtype = torch.float32, impl: str = "sdpa") -> Any:
    import transformers as tf

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = {
        "llama3": lambda: tf.LlamaConfig(
            **COMMON, rope_scaling={**rope, "original_max_position_embeddings": 32}
        ),
        "llama_mha": lambda: tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 4}),
        "qwen2": lambda: tf.Qwen2Config(**COMMON),
        "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=16),
        "mistral": lambda: tf.MistralConfig(**COMMON, sliding_window=None),
        "mistral_window": lambda: tf.MistralConfig(**COMMON, sliding_window=16),
        "phi3": lambda: tf.Phi3Config(**COMMON, pad_token_id=0),
        "gemma": lambda: tf.GemmaConfig(**COMMON, head_dim=16),
    }[name]()
    config._attn_implementation = impl
    torch.manual_seed(0)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM}
    cls |= {"mistral": tf.MistralForCausalLM, "phi3": tf.Phi3ForCausalLM, "gemma": tf.GemmaForCausalLM}
    return cls[config.model_type](config).to(dtype).eval()


def prefilled(model: Any, lengths: list[int]) -> tuple[StaticKv, list[int]]:
    """A static KV cache holding rows of ``lengths`` prompt tokens (left-padded), as the scheduler
    builds it; each row's next position."""
    from transformers import DynamicCache

    width = max(lengths)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for r, n in enumerate(lengths):
        mask[r, width - n :] = 1
    cache = DynamicCache()
    with torch.no_grad():
        model(
            ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache
        )
    like = [(layer.keys, layer.values) for layer in cache.layers]
    kv = StaticKv(like, len(lengths), 64)
    kv.add(cache, mask, 8)
    return kv, lengths


def steps(
    model: Any, lengths: list[int], lean: bool, n: int = 3, taken: bool = True
) -> tuple[list[torch.Tensor], StaticKv]:
    kv, positions = prefilled(model, lengths)
    decode = DecodeStep("eager")
    decode.attention = attention_of(model.config)
    decode.lean = lean
    out = []
    tokens = [5 + r for r in range(len(lengths))]
    with torch.no_grad():
        for _ in range(n):
            logits = decode(model, kv, tokens, positions)
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
            positions = [p + 1 for p in positions]
    assert decode.lean_steps == (n if lean and taken else 0)
    return out, kv


@pytest.mark.parametrize("name", ["llama3", "llama_mha", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[7, 3, 5], [4, 4]])
def test_lean_step_is_the_full_forward(name: str, dtype: torch.dtype, lengths: list[int]) -> None:
    model = model_of(name, dtype)
    assert lean_step(model, attention_of(model.config)) is not None
    (lean, kv_lean), (full, kv_full) = steps(model, lengths, True), steps(model, lengths, False)
    for a, b in zip(lean, full, strict=True):
        assert torch.equal(a, b)
    for x, y in zip(kv_lean.keys + kv_lean.values, kv_full.keys + kv_full.values, strict=True):
        assert torch.equal(x, y)


def test_eager_attention_models_step_lean_too() -> None:
    model = model_of("qwen2", impl="eager")
    (lean, _), (full, _) = steps(model, [6, 2], True), steps(model, [6, 2], False)
    assert all(torch.equal(a, b) for a, b in zip(lean, full, strict=True))


@pytest.mark.parametrize("name", ["mistral_window", "phi3", "gemma"])
def test_other_forwards_are_not_taken(name: str) -> None:
    model = model_of(name)
    assert lean_step(model, attention_of(model.config)) is None
    steps(model, [5, 3], True, n=1, taken=False)  # the full forward ran: no lean step counted


def test_the_engine_decodes_through_it(tiny_engine: Any) -> None:
    before = tiny_engine.scheduler.decode.lean_steps
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (c,) = asyncio.run(tiny_engine.generate([5, 6, 7, 8, 9, 10, 11], params))
    assert len(c.token_ids) == 6 and tiny_engine.scheduler.decode.lean_steps - before == 5
