"""The decode step of the Llama-shaped families through the model's own leaf modules, without the
model's ``forward`` machinery around them (docs/benchmarks/engine.md, "One uniform a row, and the
eager step through the model's leaf modules").

On CPU a decode step of a small body is mostly Python: transformers' model forward builds its mask
mapping, position and cache bookkeeping, output records and keyword plumbing through every decoder
layer, where the step itself is a few matrix products a layer (one step over the static KV cache of
a 3.9 M-parameter body at 8 rows: 4.7-5.1 ms through ``model(...)``, 4.1-4.2 ms through the leaf
modules, the same logits to the bit). The step
here calls what the decoder layers call, in their order: the embedding, the rotary embedding, each
layer's norms, projections (Qwen3's per-head q/k norms too), the family's own
``apply_rotary_pos_emb``, the configured attention function (transformers' ``sdpa`` or ``eager``
interface, the one ``LlamaAttention.forward`` dispatches to), the MLP, the final norm and the head.
Leaf modules are called as modules, so LoRA hooks on the projections
(``rollout_svc.engines.torch.lora``) and hub kernels on the norms apply as in the full forward.

Only checkpoints whose decoder layers are known to compute exactly this are taken (``lean_step``
returns None otherwise and the full forward runs): Llama, Mistral, Qwen2 and Qwen3 without a sliding
window, ``silu`` MLPs, no soft-capping, no tensor-parallel split; the per-layer check reads each
layer's class and submodules. ``tests/rollout_modes/test_lean_decode.py`` holds the logits equal to
the model's own forward on random-weight checkpoints of each family, padded rows included.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loom.architectures import Attention

# model type -> the decoder layer class name whose forward this step reproduces
LEAN_LAYERS = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LeanStep:
    """What one model's lean step calls (``lean_step``)."""

    model: Any
    rope: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the family's apply_rotary_pos_emb
    attend: Callable[..., tuple[torch.Tensor, Any]]  # transformers' attention interface
    qk_norm: bool  # Qwen3: RMSNorm over each head's queries and keys before the rotation

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, kv: Any, mask: Any) -> torch.Tensor:
        """Logits (rows, vocab) of feeding ``ids`` (rows, 1) at ``positions`` (rows, 1): each layer's
        keys and values go through ``kv.write`` (``kv.StaticKv``), ``mask`` as the full forward gets
        it (None: no row padded)."""
        body = self.model.model
        h = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(h, positions)
        for i, layer in enumerate(body.layers):
            att = layer.self_attn
            x = layer.input_layernorm(h)
            shape = (*x.shape[:-1], -1, att.head_dim)
            q, k = att.q_proj(x).view(shape), att.k_proj(x).view(shape)
            if self.qk_norm:
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = kv.write(i, k, att.v_proj(x).view(shape).transpose(1, 2))
            out, _ = self.attend(att, q, keys, values, mask, dropout=0.0, scaling=att.scaling)
            h = h + att.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(body.norm(h))[:, -1, :].float()


def lean_step(model: Any, attention: Attention | None) -> LeanStep | None:
    """The lean step of ``model``, or None where its forward is not known to be the one above."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    layer_cls = LEAN_LAYERS.get(str(model_type))
    body = getattr(model, "model", None)
    if layer_cls is None or body is None or attention is None:
        return None
    if attention.windowed or attention.attn_softcap or attention.final_softcap:
        return None
    if getattr(config, "hidden_act", None) != "silu" or (getattr(config, "pretraining_tp", 1) or 1) != 1:
        return None
    layers = getattr(body, "layers", None)
    if not layers or not all(hasattr(body, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return None
    if not hasattr(model, "lm_head"):
        return None
    qk_norm = model_type == "qwen3"
    mlp_cls = layer_cls.replace("DecoderLayer", "MLP")
    for layer in layers:
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer).__name__ != layer_cls or att is None or mlp is None:
            return None
        if not all(hasattr(att, n) for n in (*_ATTN, "head_dim", "scaling")):
            return None
        if not all(hasattr(mlp, n) for n in _MLP) or type(mlp).__name__ != mlp_cls:
            return None
        if qk_norm and not (hasattr(att, "q_norm") and hasattr(att, "k_norm")):
            return None
    module = sys.modules.get(type(layers[0].self_attn).__module__)
    rope = getattr(module, "apply_rotary_pos_emb", None)
    attend = _attention_interface(config, module)
    if rope is None or attend is None:
        return None
    return LeanStep(model, rope, attend, qk_norm)


def _attention_interface(config: Any, module: Any) -> Callable[..., tuple[torch.Tensor, Any]] | None:
    """The attention function the family's attention layer dispatches to (transformers'
    ``ALL_ATTENTION_FUNCTIONS`` for the model's implementation, the module's eager one by default);
    sdpa and eager only (others take keyword arguments this step does not pass)."""
    impl = getattr(config, "_attn_implementation", None)
    eager = getattr(module, "eager_attention_forward", None)
    if impl not in ("sdpa", "eager") or eager is None:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attend: Callable[..., tuple[torch.Tensor, Any]] = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
    return attend
