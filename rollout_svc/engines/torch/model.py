"""Loading a checkpoint, and the passes that read a whole sequence at once: the teacher-forced
reference (``teacher_forced_logprobs``) and vLLM's ``prompt_logprobs``. The group layout's block
visibility mask (``block_mask``) is shared with the engine's decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch

from loom.architectures import Attention, UnsupportedModel, attention_of, attn_implementation
from loom.layout import group_positions, group_visibility
from rollout_svc.engines.base import Layout, PromptLogprobs
from zoo.registry import resolve_model_path as resolve_model_path  # re-exported by the engine package

Dtype = Literal["float32", "bfloat16", "float16"]


def load_model(path: str | Path, device: str = "cpu", dtype: Dtype = "float32") -> Any:
    """The checkpoint in ``dtype``: its weights, and so the engine's KV cache (float32 by default).
    An architecture the engine has not been checked on is refused here (``loom.architectures``:
    ``UnsupportedModel``, a ValueError); a soft-capped one loads with eager attention, which applies
    the cap (sdpa cannot)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    att = attention_of(AutoConfig.from_pretrained(str(path)), "the torch engine")
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation=attn_implementation(att)
    )
    return model.to(device).eval()


def check_model(model: Any) -> Attention:
    """The ``Attention`` of a model the engine serves (one handed in too): refused when its
    architecture is unknown, or when it is soft-capped but runs an attention that drops the cap."""
    att = attention_of(model.config, "the torch engine")
    impl = getattr(model.config, "_attn_implementation", None)
    if att.attn_softcap is not None and impl != "eager":
        raise UnsupportedModel(
            att.model_type,
            f"attention soft-capping under {impl!r} attention (eager applies it)",
            "the torch engine",
        )
    return att


def load_adapter(adapter: str | Path, base: str | Path, device: str = "cpu", dtype: Dtype = "float32") -> Any:
    """A peft LoRA adapter directory (a ``kind=lora`` policy version) merged into ``base`` (the model
    the engine was started with): W + (alpha/r) B A on every target module, so the engine decodes a
    plain model at full speed. The adapter's ``base_model_name_or_path`` is never read: a path there
    would pick weights the adapter's publisher may not see (another key's version folder) and tell
    them which folders exist here (docs/security.md, "Publishing policy versions")."""
    from peft import PeftConfig, PeftModel

    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise ValueError("not a LoRA adapter (no adapter_config.json)")
    config = PeftConfig.from_pretrained(str(adapter))
    config.base_model_name_or_path = str(base)
    model = PeftModel.from_pretrained(load_model(base, "cpu"), str(adapter), config=config)
    merged: Any = model.merge_and_unload()  # merged in float32, then cast
    return merged.to(device=device, dtype=getattr(torch, dtype)).eval()


def merge_adapter(base: Any, adapter: str | Path, base_path: str | Path) -> Any:
    """A peft LoRA adapter directory merged into a copy of the model ``base`` (``loom engine``'s
    runtime adapters: the served base stays as it is), merged in float32 as ``load_adapter`` does,
    then put on ``base``'s own device and dtype. The adapter's ``base_model_name_or_path`` is never
    read: it is replaced by ``base_path``, the checkpoint the engine serves (as in ``load_adapter``)."""
    import copy

    from peft import PeftConfig, PeftModel

    param = next(base.parameters())
    config = PeftConfig.from_pretrained(str(adapter))
    config.base_model_name_or_path = str(base_path)
    model = copy.deepcopy(base).to(device="cpu", dtype=torch.float32)
    merged: Any = PeftModel.from_pretrained(model, str(adapter), config=config).merge_and_unload()
    return merged.to(device=param.device, dtype=param.dtype).eval()


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The model's end-of-sequence ids (its generation config's, else the tokenizer's)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))


def block_mask(groups: list[int], q_start: int, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """Additive mask (1, 1, q, kv) for queries ``groups[q_start:]`` over keys ``groups``.

    Query i sees key j iff j <= i (causal) and groups[j] <= groups[i] (source never sees target).
    """
    allowed = group_visibility(groups, q_start, device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def teacher_forced_logprobs(
    model: Any, ids: list[int], start: int, layout: Layout | None = None
) -> list[float]:
    """Log-probs of ``ids[start:]`` in ONE forward pass over the whole sequence (the reference). A
    group layout on a sliding-window model is refused (``Attention.refuse_layout``)."""
    if layout is not None:
        attention_of(model.config, "the teacher-forced pass").refuse_layout("the teacher-forced pass")
    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    kwargs: dict[str, Any] = {}
    if layout is not None:
        groups = layout.groups + [layout.gen_group] * (len(ids) - len(layout.groups))
        kwargs["position_ids"] = torch.tensor([group_positions(groups)], device=device)
        kwargs["attention_mask"] = block_mask(groups, 0, next(model.parameters()).dtype, device)
    logits = model(x, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
    return logp.gather(1, x[0, start:, None]).squeeze(1).tolist()


@torch.no_grad()
def prompt_logprobs(model: Any, token_ids: list[int], k: int, device: Any) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` in one forward pass: for every prompt token after the first, its
    log-prob and rank, and the ``k`` most likely tokens at its position (with their ranks)."""
    logits = model(torch.tensor([token_ids], device=device)).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    actual = torch.tensor(token_ids[1:], device=logp.device)
    lp = logp.gather(1, actual[:, None])
    ranks = (logp > lp).sum(dim=-1) + 1
    top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1) if k > 0 else None
    out: PromptLogprobs = [None]
    for i, (t, v, rank) in enumerate(zip(token_ids[1:], lp[:, 0].tolist(), ranks.tolist(), strict=True)):
        d = {t: (v, rank)}
        if top is not None:
            ids, values = top.indices[i].tolist(), top.values[i].tolist()
            for j, (tid, tv) in enumerate(zip(ids, values, strict=True)):
                d.setdefault(tid, (tv, j + 1))
        out.append(d)
    return out
