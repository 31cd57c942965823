"""The learner's one configuration: ``LearnerSettings``, read from ``LOOM_LEARNER_*``.

A new knob is one field here: the Celery worker (learner/tasks.py), the helper ranks
(learner/helper_rank.py, which get rank 0's settings as JSON), the benches and the tests all build the
``Learner`` from this class, and its types refuse what the learner cannot do (an unknown sharding, LoRA
with FSDP) before any model is loaded. The settings every service shares (the model, the device, the
policy store) default to the shared ``LOOM_*`` values (loom/contracts/settings.py);
``LOOM_LEARNER_MODEL``, ``LOOM_LEARNER_DEVICE`` and ``LOOM_LEARNER_STORE`` set them for the learner alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from loom.contracts.settings import Settings


def _shared(name: str) -> Any:
    """A shared setting's value as every service reads it (``LOOM_MODEL``, ``LOOM_DEVICE``, ...)."""
    return getattr(Settings(), name)


class LearnerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_LEARNER_", extra="ignore", frozen=True)

    model: str | Path = Field(
        default_factory=lambda: _shared("model"),
        description="'tiny' (zoo.tiny.CHECKPOINT_DIR) or any HF causal-LM directory (default LOOM_MODEL)",
    )
    store: Path = Field(
        default_factory=lambda: _shared("policy_store_path"),
        description="the policy store the learner publishes to (default LOOM_POLICY_STORE)",
    )
    device: str = Field(default_factory=lambda: _shared("device"), description="default LOOM_DEVICE")
    token_budget: int = Field(
        default=8192, ge=1, description="computed tokens (rows x row width) per micro-batch"
    )
    memory_budget_mib: int = Field(
        default=0,
        ge=0,
        description="> 0: the micro-batch token budget is chosen from this memory budget and the model's "
        "shape (learner/logprobs.py budget_tokens, an estimate), instead of token_budget",
    )
    packing: bool = Field(
        default=True,
        description="several trajectories per row (position ids restarting, attention inside each); "
        "False: one padded row per trajectory",
    )
    logprob_chunk: int = Field(
        default=4096,
        ge=0,
        description="tokens per chunk of the fused output projection + log-softmax + entropy (no "
        "tokens x vocabulary float32 logits at once); 0: the whole logits from the model's forward",
    )
    logprob_keep_mib: int = Field(
        default=256,
        ge=0,
        description="the fused head keeps a micro-batch's float32 logits for backward when they fit in "
        "this many MiB, instead of recomputing them chunk by chunk (0: always recompute)",
    )
    segment_attention: bool | None = Field(
        default=None,
        description="packed rows attend per trajectory (learner/segment_attention.py: attention costs "
        "sum(L_i^2), not row^2) where the model runs sdpa; False: sdpa with the row's block mask; unset: "
        "per trajectory except on CUDA, where one sdpa per trajectory and layer is launch-bound "
        "(docs/benchmarks/gpu.md: 26.6k vs 37.3k tok/s at 1 B on an H200)",
    )
    torch_compile: Literal["off", "inductor", "aot_eager", "eager"] = Field(
        default="off",
        description="torch.compile each decoder layer with this backend (dynamic shapes); 'inductor' is "
        "the fast one; on CPU (a C++ compiler needed) the packed 10m step took 4-10 % fewer CPU seconds "
        "after 23-62 s of compilation on the first step (docs/benchmarks/learner.md), so it stays off "
        "by default; 'eager'/'aot_eager' trace without code generation",
    )
    weight_decay: float = Field(default=0.01, ge=0.0, description="AdamW's (AdaSR Table 9)")
    betas: tuple[float, float] = (0.9, 0.999)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="the dtype the learner's weights (its master weights, so the published versions) "
        "load in: float32 by default whatever the checkpoint was saved in (mixed_precision's bf16 "
        "compute keeps float32 master weights); 'auto' is the checkpoint's own on CUDA, float32 on CPU; "
        "'bfloat16' trains the weights themselves in bf16",
    )
    mixed_precision: Literal["auto", "no", "bf16"] = Field(
        default="auto",
        description="bf16 compute with float32 master weights; 'auto' is bf16 on CUDA, float32 on CPU "
        "(replicated ranks autocast, FSDP casts the gathered parameters with float32 reductions)",
    )
    sharding: Literal["replicate", "fsdp"] = Field(
        default="replicate",
        description="with --nproc N > 1: 'replicate' holds the whole model on every rank, 'fsdp' shards "
        "parameters, gradients and optimizer state over the ranks (FSDP2, learner/distributed.py)",
    )
    lora_rank: int = Field(default=0, ge=0, description="> 0: train a LoRA adapter of this rank (needs peft)")
    lora_alpha: int = Field(default=16, ge=1, description="the LoRA adapter's alpha")
    lora_targets: Annotated[tuple[str, ...], NoDecode] = Field(
        default=("q_proj", "k_proj", "v_proj", "o_proj"),
        description="the module names LoRA adapts (comma-separated in the environment)",
    )
    lora_merge: bool = Field(
        default=False,
        description="with LoRA: publish the merged model (W + (alpha/r) B A) as a full checkpoint for "
        "engines without adapter support; the adapter is kept beside it for resume",
    )
    save_optimizer: bool = True
    resident_runs: int = Field(
        default=2,
        ge=1,
        le=64,
        description="runs' lineages (and the learner's own) whose model and optimizer stay in memory; "
        "another is loaded from the policy store when its batch comes (docs/operations.md)",
    )
    keep_versions: int = Field(default=0, ge=0, description="> 0: prune older versions after publishing")
    drop_zero: bool = Field(default=True, description="leave zero-advantage samples out of the update")
    activation_checkpointing: bool = Field(
        default=False, description="recompute activations in backward: less memory, more time"
    )
    max_wait_s: float = Field(
        default=1800.0,
        gt=0,
        description="the longest a learner API request may ask to wait (train_step ?timeout=, "
        "score/attention timeout); more is a 422",
    )
    nproc: int = Field(
        default=1,
        ge=1,
        description="learner ranks `loom worker learner` starts when --nproc is not given (one per GPU, "
        "NCCL; gloo on CPU)",
    )

    @field_validator("lora_targets", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        return tuple(t.strip() for t in v.split(",") if t.strip()) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _lora_replicated(self) -> LearnerSettings:
        if self.sharding == "fsdp" and self.lora_rank > 0:
            # peft's adapter save/merge walks plain tensors; an FSDP-sharded adapter is not supported
            raise ValueError("LoRA (lora_rank > 0) with sharding='fsdp' is not supported: use 'replicate'")
        return self
