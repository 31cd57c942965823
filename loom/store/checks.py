"""What a published checkpoint may be, checked from its files' text before anything is allocated
(docs/security.md, "Publishing policy versions").

A ``config.json`` is a promise of sizes: transformers allocates every tensor it declares and fills
what the weights lack at random, so a 25 KB upload could make a replica build a 666 M-parameter model.
Here the config's dimensions and parameter count are computed and bounded relative to the
deployment's base model (``PublishLimits``), its architecture must be the base's (one of
``loom.architectures.ARCHITECTURES``), and every tensor of every ``.safetensors`` file is read from
the file's header alone (8 bytes of length, then JSON; no weight is loaded) and must be exactly the
tensor the config declares, with none missing and none extra. A LoRA adapter is checked the same way
against the base it is applied to: the deployment's base model, never a path in its own config.
Refusals are ``CheckpointRefused`` (422 ``invalid_checkpoint``), naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loom.architectures import ARCHITECTURES
from loom.store.errors import PublishError

MAX_HEADER_BYTES = 16 * 1024**2  # a safetensors header: JSON naming the tensors, never the weights
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
PREFIX = "base_model.model."  # peft's prefix of an adapter's tensor names


class CheckpointRefused(PublishError):
    """A checkpoint whose files declare something this deployment does not serve, or whose weights are
    not the tensors its config declares."""

    status, error = 422, "invalid_checkpoint"


@dataclass(frozen=True)
class Dims:
    """A config's sizes: what a replica would allocate for it."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    positions: int
    tied: bool
    experts: int
    expert_intermediate: int
    shared_intermediate: int

    @property
    def params(self) -> int:
        """Parameters of the model the config declares (the dense families' layout, experts counted;
        biases and per-head norms, a few thousand, left out)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * q * 2 + h * kv * 2
        if self.experts:
            mlp = self.experts * (3 * h * self.expert_intermediate + h) + 3 * h * self.shared_intermediate
        else:
            mlp = 3 * h * self.intermediate
        heads = 1 if self.tied else 2
        return heads * self.vocab * h + self.layers * (attn + mlp + 2 * h) + h


def _int(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    v = cfg.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if default == 0 else 1):
        raise CheckpointRefused(f"{where}: {key} must be a positive integer")
    return v


def dims_of(cfg: dict[str, Any], where: str = "config.json") -> Dims:
    """The ``Dims`` a transformers config declares; refused when a size is missing or not an integer."""
    if not isinstance(cfg, dict):
        raise CheckpointRefused(f"{where} is not a JSON object")
    model_type = str(cfg.get("model_type") or "")
    if model_type not in ARCHITECTURES:
        raise CheckpointRefused(f"{where}: model_type {model_type!r} is not an architecture Loom serves")
    hidden = _int(cfg, "hidden_size", where)
    heads = _int(cfg, "num_attention_heads", where)
    head_dim = cfg.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim < 1:
        raise CheckpointRefused(f"{where}: head_dim must be a positive integer")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    return Dims(
        model_type=model_type,
        vocab=_int(cfg, "vocab_size", where),
        hidden=hidden,
        layers=_int(cfg, "num_hidden_layers", where),
        intermediate=_int(cfg, "intermediate_size", where),
        heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", where, heads),
        head_dim=head_dim,
        positions=_int(cfg, "max_position_embeddings", where),
        tied=bool(cfg.get("tie_word_embeddings", True)),
        experts=_int({"n": experts}, "n", where, 0) if experts else 0,
        expert_intermediate=_int(cfg, "moe_intermediate_size", where, 0) if experts else 0,
        shared_intermediate=_int(cfg, "shared_expert_intermediate_size", where, 0) if experts else 0,
    )


def read_config(path: Path) -> dict[str, Any]:
    try:
        out = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointRefused(f"{path.name} is missing") from None
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointRefused(f"{path.name} is not JSON") from None
    if not isinstance(out, dict):
        raise CheckpointRefused(f"{path.name} is not a JSON object")
    return out


def safetensors_header(path: Path, name: str) -> dict[str, tuple[int, ...]]:
    """The tensors a safetensors file holds, name -> shape, from its header alone; every entry's dtype,
    shape and byte range checked against the file's size (a file the loader would reject is refused
    here, not at a replica)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointRefused(f"{name} is not a safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointRefused(f"{name}: the safetensors header is larger than the file allows")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CheckpointRefused(f"{name}: the safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise CheckpointRefused(f"{name}: the safetensors header is not a JSON object")
    data = size - 8 - n
    out: dict[str, tuple[int, ...]] = {}
    for tensor, entry in header.items():
        if tensor == "__metadata__":
            continue
        if not _well_formed(entry, data):
            raise CheckpointRefused(f"{name}: tensor {tensor!r} has a malformed header entry")
        out[tensor] = tuple(entry["shape"])
    return out


def _well_formed(entry: Any, data: int) -> bool:
    """A header entry the loader takes: a known dtype, a shape of non-negative ints, and a byte range
    inside the file's data that holds exactly that many elements."""
    if not isinstance(entry, dict) or entry.get("dtype") not in ITEMSIZE:
        return False
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return False
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        return False
    start, end = offsets
    return 0 <= start <= end <= data and end - start == math.prod(shape) * ITEMSIZE[entry["dtype"]]


def expected_tensors(d: Dims) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors a checkpoint of ``d`` holds (name -> shape) and which of them may be left out
    (biases, a tied head, rotary buffers); any other name is refused."""
    h, q, kv, i = d.hidden, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate
    want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, h), "model.norm.weight": (h,)}
    optional = set()
    want["lm_head.weight"] = (d.vocab, h)
    if d.tied:
        optional.add("lm_head.weight")
    for n in range(d.layers):
        p = f"model.layers.{n}."
        want[p + "input_layernorm.weight"] = (h,)
        want[p + "post_attention_layernorm.weight"] = (h,)
        if d.model_type in ("gemma2", "gemma3_text"):
            want[p + "pre_feedforward_layernorm.weight"] = (h,)
            want[p + "post_feedforward_layernorm.weight"] = (h,)
        if d.model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            want[p + "self_attn.q_norm.weight"] = (d.head_dim,)
            want[p + "self_attn.k_norm.weight"] = (d.head_dim,)
        if d.model_type == "phi3":
            projections = {"self_attn.qkv_proj": (q + 2 * kv, h), "self_attn.o_proj": (h, q)}
            projections |= {"mlp.gate_up_proj": (2 * i, h), "mlp.down_proj": (h, i)}
        else:
            projections = {
                "self_attn.q_proj": (q, h),
                "self_attn.k_proj": (kv, h),
                "self_attn.v_proj": (kv, h),
                "self_attn.o_proj": (h, q),
            }
            if d.experts:
                e_i, s_i = d.expert_intermediate, d.shared_intermediate
                want[p + "mlp.gate.weight"] = (d.experts, h)
                for e in range(d.experts):
                    x = f"mlp.experts.{e}."
                    projections |= {
                        x + "gate_proj": (e_i, h),
                        x + "up_proj": (e_i, h),
                        x + "down_proj": (h, e_i),
                    }
                if s_i:
                    x = "mlp.shared_expert."
                    projections |= {
                        x + "gate_proj": (s_i, h),
                        x + "up_proj": (s_i, h),
                        x + "down_proj": (h, s_i),
                    }
                    want[p + "mlp.shared_expert_gate.weight"] = (1, h)
            else:
                projections |= {"mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
        for name, shape in projections.items():
            want[p + name + ".weight"] = shape
            want[p + name + ".bias"] = (shape[0],)
            optional.add(p + name + ".bias")
        want[p + "self_attn.rotary_emb.inv_freq"] = (d.head_dim // 2,)
        optional.add(p + "self_attn.rotary_emb.inv_freq")
    return want, optional


@dataclass(frozen=True)
class Bounds:
    """What a published version may declare: the deployment base's ``Dims`` and how many times its
    size a version may be (``max_params`` 0: ``factor`` x the base's parameters)."""

    base: Dims
    factor: float
    max_params: int = 0

    @classmethod
    def of(cls, base_dir: Path, factor: float, max_params: int = 0) -> Bounds:
        return cls(
            dims_of(read_config(base_dir / "config.json"), "the base model's config.json"), factor, max_params
        )

    def check(self, d: Dims) -> None:
        b = self.base
        if d.model_type != b.model_type:
            raise CheckpointRefused(
                f"config.json: model_type {d.model_type!r} is not the deployment's ({b.model_type!r})"
            )
        if d.vocab != b.vocab:  # the replicas tokenize and decode with the deployment's tokenizer
            raise CheckpointRefused(
                f"config.json: vocab_size {d.vocab} is not the deployment's tokenizer's ({b.vocab})"
            )
        for field, got, base in (
            ("num_hidden_layers", d.layers, b.layers),
            ("hidden_size", d.hidden, b.hidden),
            ("intermediate_size", d.intermediate, b.intermediate),
            ("max_position_embeddings", d.positions, b.positions),
            ("num_experts", d.experts, b.experts),
        ):
            if got > max(self.factor * base, base):
                raise CheckpointRefused(
                    f"config.json: {field} {got} is over {self.factor:g} x the base model's {base} "
                    "(LOOM_GATEWAY_POLICY_SIZE_FACTOR)"
                )
        limit = self.max_params or int(self.factor * b.params)
        if d.params > limit:
            raise CheckpointRefused(
                f"config.json declares {d.params} parameters; a version may hold {limit} "
                "(LOOM_GATEWAY_POLICY_SIZE_FACTOR x the base model's, or LOOM_GATEWAY_POLICY_MAX_PARAMS)"
            )


def tensors_in(folder: Path, paths: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the top-level ``.safetensors`` files among ``paths`` (what transformers and
    peft load; a subfolder's, such as the learner's ``adapter/`` beside its merged weights, is not
    loaded): name -> (shape, file)."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for rel in paths:
        if not rel.endswith(".safetensors") or "/" in rel:
            continue
        for name, shape in safetensors_header(folder / rel, rel).items():
            if name in out:
                raise CheckpointRefused(f"{rel}: tensor {name!r} is also in {out[name][1]}")
            out[name] = (shape, rel)
    if not out:
        raise CheckpointRefused("the version holds no .safetensors weights")
    return out


def check_full(folder: Path, paths: list[str], bounds: Bounds) -> None:
    d = dims_of(read_config(folder / "config.json"))
    bounds.check(d)
    want, optional = expected_tensors(d)
    got = tensors_in(folder, paths)
    for name, (shape, rel) in got.items():
        if name not in want:
            raise CheckpointRefused(f"{rel}: tensor {name!r} is not one a {d.model_type} config declares")
        if shape != want[name]:
            raise CheckpointRefused(
                f"{rel}: tensor {name!r} has shape {list(shape)}; config.json declares {list(want[name])}"
            )
    missing = sorted(set(want) - set(got) - optional)
    if missing:
        raise CheckpointRefused(
            f"the weights lack {len(missing)} tensors config.json declares, e.g. {missing[0]!r}"
        )


LORA_TENSOR = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")


def check_lora(folder: Path, paths: list[str], bounds: Bounds) -> None:
    """An adapter of the deployment's base: its rank bounded by the base's hidden size, and every
    tensor a ``lora_A`` ([r, in]) or ``lora_B`` ([out, r]) of one of the base's own projections.
    Its config's ``base_model_name_or_path`` is never read: an adapter applies to the deployment's
    base, whatever it names (a path there must not choose another key's weights, or probe a folder)."""
    cfg = read_config(folder / "adapter_config.json")
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise CheckpointRefused("adapter_config.json: peft_type must be LORA")
    r = _int(cfg, "r", "adapter_config.json")
    if r > bounds.base.hidden:
        raise CheckpointRefused(
            f"adapter_config.json: r {r} is over the base model's hidden size {bounds.base.hidden}"
        )
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
        raise CheckpointRefused(
            "adapter_config.json: rank_pattern, alpha_pattern and modules_to_save are not served"
        )
    want, _ = expected_tensors(bounds.base)
    for name, (shape, rel) in tensors_in(folder, paths).items():
        m = LORA_TENSOR.fullmatch(name.removeprefix(PREFIX))
        base = want.get(m["module"] + ".weight") if m else None
        if m is None or base is None or len(base) != 2:
            raise CheckpointRefused(f"{rel}: tensor {name!r} adapts no projection of the base model")
        out, inp = base
        expect = (r, inp) if m["ab"] == "A" else (out, r)
        if shape != expect:
            raise CheckpointRefused(
                f"{rel}: tensor {name!r} has shape {list(shape)}; the base model needs {list(expect)}"
            )


def check_checkpoint(folder: Path, paths: list[str], kind: str, bounds: Bounds) -> None:
    """``CheckpointRefused`` unless the files ``paths`` of ``folder`` are a checkpoint (``kind`` full)
    or an adapter (lora) this deployment serves within ``bounds``; reads configs and headers only."""
    (check_lora if kind == "lora" else check_full)(folder, paths, bounds)


class LoraBaseRefused(CheckpointRefused):
    """A LoRA version whose declared base is not the model the deployment applies adapters to."""

    error = "lora_base_mismatch"


def declared_base(meta: dict[str, Any]) -> int:
    """The base version a LoRA version's record declares (``base_version``, written by the learner
    from its run's lineage: ``learner.train``); none declared: version 0, the deployment's base."""
    value = meta.get("base_version", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LoraBaseRefused("the version's record declares no valid base_version")
    return value


def check_lora_base(kind: str, meta: dict[str, Any]) -> None:
    """A LoRA version applies to its namespace's declared base, never to a path of its own config
    (``check_lora``). A deployment applies adapters to one base, its base model (version 0, which
    every namespace shares): a LoRA whose lineage starts from another version (a key's full version)
    was trained on other weights, and applied to the base its log-probs would be another model's.
    Refused (``LoraBaseRefused``), never served on the wrong base."""
    if kind != "lora":
        return
    base = declared_base(meta)
    if base != 0:
        raise LoraBaseRefused(
            f"the LoRA version's base is version {base} of its lineage; this deployment applies "
            "adapters to its base model (version 0) only"
        )
