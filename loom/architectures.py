"""The checkpoint architectures Loom computes exactly, and what each one's attention and head need
beyond plain causal attention (docs/models.md, "Your own checkpoints").

Every path that computes attention or logits itself (the torch engine's decode step over its static
KV cache and its group layout, the learner's segment attention and fused log-prob head, the FCI
scorer) reads a checkpoint's ``Attention`` from here and either honours what it declares (sliding
windows, uniform or per layer; attention and final-logit soft-capping) or refuses the model with an
``UnsupportedModel`` naming the feature. A model type that is not in ``ARCHITECTURES`` is refused at
load: Loom's masks and caches were checked against these families only (exact or refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"


class UnsupportedModel(ValueError):
    """A checkpoint (or a request on it) that a path cannot compute exactly: the reason names the
    model type and the feature."""

    def __init__(self, model_type: str, feature: str, where: str) -> None:
        self.model_type, self.feature, self.where = model_type, feature, where
        super().__init__(f"{where} cannot serve model type {model_type!r}: {feature}")


@dataclass(frozen=True)
class Family:
    """One architecture family as transformers implements it."""

    name: str
    # the model's forward takes a dict {layer type: 4D mask} for its per-layer windows (transformers'
    # ``causal_mask_mapping``); a family without it has one mask for every layer
    mask_per_layer_type: bool


ARCHITECTURES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", False),
        Family("mistral", False),
        Family("qwen2", True),
        Family("qwen3", True),
        Family("qwen2_moe", True),
        Family("qwen3_moe", False),
        Family("phi3", False),
        Family("gemma", False),
        Family("gemma2", True),
        Family("gemma3_text", True),
    )
}


@dataclass(frozen=True)
class Attention:
    """What one checkpoint's attention and output head compute beyond causal attention."""

    model_type: str
    windows: tuple[int | None, ...]  # per layer: the sliding window (keys q - k < w), None = full
    attn_softcap: float | None  # scores -> c tanh(scores / c) before the softmax
    final_softcap: float | None  # logits -> c tanh(logits / c)
    mask_per_layer_type: bool

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.windows)

    @property
    def uniform_window(self) -> bool:
        """Every layer has the same window (or none has one): one mask serves every layer."""
        return len(set(self.windows)) <= 1

    @property
    def window(self) -> int | None:
        """The sliding layers' window (all sliding layers of the supported families share one)."""
        return next((w for w in self.windows if w is not None), None)

    def refuse_layout(self, where: str) -> None:
        """The group layout (StreamingThinker's per-group positions and block mask) has no defined
        sliding window: its keys are not one contiguous sequence. Refused rather than guessed."""
        if self.windowed:
            raise UnsupportedModel(
                self.model_type,
                f"sliding-window attention (window {self.window}) with the group layout "
                "(streaming's group_positions) is not supported; the interleaved layout, plain, tree "
                "and spawn rollouts are",
                where,
            )


def attention_of(config: Any, where: str = "Loom") -> Attention:
    """The ``Attention`` of a transformers config; ``UnsupportedModel`` for a model type Loom has not
    checked, or one whose per-layer windows its forward cannot take per layer type."""
    model_type = str(getattr(config, "model_type", "") or "")
    family = ARCHITECTURES.get(model_type)
    if family is None:
        known = ", ".join(sorted(ARCHITECTURES))
        raise UnsupportedModel(
            model_type or "(none)", f"not one of the supported architectures ({known})", where
        )
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        windows = tuple(int(window) if t == SLIDING and window else None for t in types)
        unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
        if unknown:
            raise UnsupportedModel(model_type, f"layer types {unknown}", where)
    else:  # no layer types: the window, when set, is every layer's (Mistral, Phi3)
        windows = (int(window) if window else None,) * n
    att = Attention(
        model_type,
        windows,
        getattr(config, "attn_logit_softcapping", None) or None,
        getattr(config, "final_logit_softcapping", None) or None,
        family.mask_per_layer_type,
    )
    if not att.uniform_window and not att.mask_per_layer_type:
        raise UnsupportedModel(model_type, "per-layer sliding windows in a single-mask forward", where)
    return att


def attn_implementation(att: Attention) -> str:
    """The attention a checkpoint is loaded with: sdpa, or eager where sdpa would drop the attention
    soft-cap (transformers' sdpa takes no ``softcap``; Gemma2 declares ``_supports_sdpa = False``)."""
    return "eager" if att.attn_softcap is not None else "sdpa"


# the projections some families fuse into one Linear (Phi3: qkv_proj, gate_up_proj)
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}


def lora_targets(model_type: str, linear_names: list[str], targets: list[str]) -> list[str]:
    """The module names LoRA adapts on a model whose Linear layers are ``linear_names`` (dotted
    paths): each requested target that names a layer (its last component), else the fused
    projection holding it (``q_proj`` -> ``qkv_proj`` on Phi3: the adapter then spans q, k and v),
    in the order asked, each once; a target that matches neither is refused naming the model's own
    layers (peft would adapt the others and say nothing of it)."""
    leaves = {n.rsplit(".", 1)[-1] for n in linear_names}
    out: list[str] = []
    for t in targets:
        name = t if t in leaves else FUSED.get(t)
        if name is None or name not in leaves:
            raise UnsupportedModel(
                model_type,
                f"LoRA target {t!r} matches no layer (its linear layers: {sorted(leaves)})",
                "LoRA",
            )
        if name not in out:
            out.append(name)
    return out


DTYPES = ("float32", "bfloat16", "float16")


def resolve_dtype(setting: str, config: Any, device: str) -> str:
    """The dtype a checkpoint loads in: ``setting`` when it names one; ``"auto"``: the checkpoint's
    own (its config's ``dtype``/``torch_dtype``) on CUDA, float32 on CPU (CPU kernels are float32's;
    half precision there is slower and only approximate, docs/benchmarks/engine.md)."""
    if setting != "auto":
        if setting not in DTYPES:
            raise ValueError(f"dtype {setting!r} is not one of auto, {', '.join(DTYPES)}")
        return setting
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    saved = str(saved).removeprefix("torch.") if saved is not None else "float32"
    return saved if device.startswith("cuda") and saved in DTYPES else "float32"
