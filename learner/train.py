"""The train step: advantages -> recomputed log-probs -> loss -> AdamW step -> new policy version.

One ``Learner`` trains every run's lineage (docs/security.md "Runs' lineages"): a batch names its
run's ``Lineage`` and the learner switches to that lineage's state (``Resident``: model, optimizer,
newest record), held in memory for the ``resident_runs`` most recently trained and otherwise loaded
from the policy store (its newest version: weights and optimizer state; or its base). It trains one
optimizer step per ``TrainBatch`` (micro-batched by a token budget, gradients accumulated) and
publishes the new version (full safetensors, or a LoRA adapter) into the lineage's namespace. A batch
whose (lineage, step) was already published (a redelivered task) returns the stored result. A batch
without a lineage trains the learner's own namespace (benches, direct callers of /v1/train_step).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import shutil
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from learner import logprobs as lp
from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.distributed import OneProcess, Ranks, collective, layout
from learner.estimators import TokenAdvantages, estimator
from learner.losses import LossParts, LossTerms, pad_rows, policy_loss
from learner.mismatch import kl_k1, kl_k3, mismatch_log_ratio, ratio_percentiles, tis_weights, weights_or_one
from loom.architectures import attention_of, attn_implementation, lora_targets, resolve_dtype
from loom.contracts.wire import Lineage, LossSpec, PolicyVersion, StepResult, TisLevel, TrainBatch
from loom.runtime import MODEL_LOADS
from loom.store import PolicyStore
from loom.store.checks import check_lora_base
from loom.store.layout import REGISTERED
from loom.vocab import outside_vocabulary
from zoo.registry import resolve_model_path  # re-exported: bench/learner.py names it

log = logging.getLogger("loom.learner")

# the behaviour-vs-learner metrics of a multi-pass step are the first pass's (pi_old = the policy
# that started the batch); later passes' log-probs have moved away from it
FIRST_PASS_METRICS = ("logprob_mismatch_", "mismatch_", "tis_")

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_DIR = "adapter"  # the trained adapter inside a merged LoRA version (lora_merge)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
)


class AttentionVersionUnavailable(Exception):
    """The version an attention-scoring request names is not one this learner can load."""


def _load_causal_lm(path: Path, dtype: str = "float32", device: str = "cpu") -> Any:
    """The checkpoint in ``dtype`` (``LearnerSettings.dtype``, resolved for ``device``:
    ``loom.architectures.resolve_dtype``); an architecture Loom has not checked is refused here
    (``loom.architectures.UnsupportedModel``), a soft-capped one runs eager attention (sdpa drops the cap)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    att = attention_of(config, "the learner")
    return AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=getattr(torch, resolve_dtype(dtype, config, device)),
        attn_implementation=attn_implementation(att),
    )


@dataclass
class Resident:
    """One lineage's training state in memory: its store view, model, optimizer and newest record.
    Every step publishes the weights and (``save_optimizer``) the optimizer state to the store, so a
    state dropped from memory is rebuilt from there (``Learner._open``) as it was."""

    store: PolicyStore
    model: Any
    optimizer: Any
    token_budget: int
    version: int
    record: PolicyVersion | None
    base_path: Path  # the checkpoint the lineage starts from (a LoRA adapter's base)
    base_version: int = 0  # warmup counts the optimizer steps above it


class Learner:
    def __init__(self, cfg: LearnerSettings, ranks: Ranks | None = None) -> None:
        self.cfg = cfg
        # one process, or N ranks (learner/distributed.py): each trains its share, gradients summed,
        # rank 0 publishes; decided here once, the train step calls the same methods either way
        self.ranks = layout(ranks, cfg.sharding)
        self.home = PolicyStore(cfg.store)  # the learner's own namespace (batches without a lineage)
        self.base_path = resolve_model_path(cfg.model)
        self.device = self.ranks.device(cfg.device)
        self._ref: Any = None
        self._gathered: tuple[dict[str, Any], dict[str, Any] | None] | None = None
        # the lineages held in memory, least recently trained first; the last is the one training
        # (docs/operations.md "Runs on one learner")
        self.resident: OrderedDict[str | None, Resident] = OrderedDict()
        self.resident[None] = self._open(self.home, self.base_path, 0)
        # the last version loaded for attention scores alone (``scoring_model``): (namespace, version)
        self._scoring: tuple[tuple[str | None, int], Any] | None = None

    # the state of the lineage training now (``_switch``)
    @property
    def state(self) -> Resident:
        return next(reversed(self.resident.values()))

    @property
    def model(self) -> Any:
        return self.state.model

    @property
    def optimizer(self) -> Any:
        return self.state.optimizer

    @property
    def store(self) -> PolicyStore:
        return self.state.store

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def record(self) -> PolicyVersion | None:
        return self.state.record

    @property
    def token_budget(self) -> int:
        return self.state.token_budget

    def _open(self, store: PolicyStore, base_path: Path, base_version: int) -> Resident:
        """A lineage's state from the store: its newest version (weights, optimizer state), or its
        base with a fresh optimizer when it has published none."""
        cfg = self.cfg
        latest = store.latest()
        with MODEL_LOADS:  # one checkpoint at a time per process (loom.runtime)
            model = self._load(latest, base_path)
        if cfg.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.torch_compile != "off":
            compile_layers(model, cfg.torch_compile)
        budget = micro_batch_budget(model, cfg, self.compute_dtype())
        model.to(self.device)
        model.train()
        self.ranks.prepare(model, "bf16" if self.compute_dtype() is not None else "no")
        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=LossSpec().lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        saved = None if latest is None else Path(latest.path) / OPTIMIZER_FILE
        if saved is not None and saved.exists():
            state = torch.load(saved, map_location=self.device, weights_only=True)
            self.ranks.load_optimizer(model, optimizer, state)
        if latest is not None:
            self.ranks.resume(model, optimizer, store.root, latest.version)
            log.info("learner resumed from policy version %d (%s)", latest.version, latest.path)
        version = latest.version if latest is not None else base_version
        return Resident(store, model, optimizer, budget, version, latest, base_path, base_version)

    def _switch(self, lineage: Lineage | None) -> None:
        """Make ``lineage`` (None: the learner's own namespace) the one training: its resident state,
        or its state loaded from the store; the least recently trained beyond ``resident_runs`` leave
        memory (their state is in the store: every step published it)."""
        key = None if lineage is None else lineage.namespace
        if key in self.resident:
            self.resident.move_to_end(key)
            return
        base = (self.base_path, 0) if lineage is None else self._base_of(lineage)
        # room first: the memory never holds more than ``resident_runs`` lineages, not even mid-switch
        while len(self.resident) >= self.cfg.resident_runs:
            self.resident.popitem(last=False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        store = self.home if lineage is None else self.home.namespace(lineage.namespace)
        try:
            self.resident[key] = self._open(store, *base)
        except Exception:
            if not self.resident:  # the learner always holds one lineage: its own, again
                self.resident[None] = self._open(self.home, self.base_path, 0)
            raise

    def _base_of(self, lineage: Lineage) -> tuple[Path, int]:
        """The checkpoint ``lineage`` starts from and its version: the deployment's base model
        (version 0), or a full version of the named namespace (the gateway checked that it is the
        run's key's own: docs/security.md)."""
        if lineage.base_version == 0:
            return self.base_path, 0
        view = self.home.namespace(lineage.base_namespace)
        record = view.get(lineage.base_version)
        if record is None:
            raise ValueError(f"the base of lineage {lineage.namespace!r} is not in the policy store")
        if record.kind != "full":
            raise ValueError(f"the base of lineage {lineage.namespace!r} is a LoRA adapter, not a checkpoint")
        if record.meta.get(REGISTERED):  # a registered path stays its trainer's: checked before loading
            view.verify(record.version)
        return view.source_of(record), record.version

    def scoring_model(self, namespace: str | None, version: int) -> Any:
        """The model of exactly ``version`` of ``namespace`` (version 0: the base model), for attention
        scores (docs/security.md "Runs' lineages"): a resident lineage's when it holds that version
        now, else loaded from the store (one such model kept). Never another version or lineage's
        weights: ``AttentionVersionUnavailable`` when that version cannot be loaded."""
        key = (None if version == 0 else namespace, version)  # version 0 is every namespace's base
        for r in self.resident.values():
            if r.record is not None:
                held: tuple[str | None, int] | None = (r.record.namespace, r.record.version)
            else:
                held = (None, 0) if r.base_version == 0 else None
            if held == key:
                return r.model
        if self._scoring is not None and self._scoring[0] == key:
            return self._scoring[1]
        self._scoring = None  # room first: one scoring model at a time
        model = self._read_version(*key)
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self._scoring = (key, model)
        return model

    def _read_version(self, namespace: str | None, version: int) -> Any:
        name = f"policy version {version}" + (f" of namespace {namespace!r}" if namespace else "")
        if version == 0:
            with MODEL_LOADS:
                return _load_causal_lm(self.base_path, self.cfg.dtype, self.device.type)
        try:
            view = self.home.namespace(namespace)
            record = view.get(version)
        except ValueError:  # not a namespace name
            record = None
        if record is None:
            raise AttentionVersionUnavailable(f"{name} is not in the policy store")
        try:
            if record.meta.get(REGISTERED):  # a registered path stays its trainer's: checked first
                view.verify(record.version)
            with MODEL_LOADS:
                if record.kind == "lora":  # applied to the base model, its only base (check_lora_base)
                    from peft import PeftModel

                    check_lora_base(record.kind, record.meta)
                    base = _load_causal_lm(self.base_path, self.cfg.dtype, self.device.type)
                    adapter = PeftModel.from_pretrained(base, str(view.source_of(record)))
                    return adapter.merge_and_unload()
                return _load_causal_lm(view.source_of(record), self.cfg.dtype, self.device.type)
        except Exception as exc:  # noqa: BLE001 (any failure: a typed refusal, never another model)
            log.warning("attention scores: could not load %s: %s: %s", name, type(exc).__name__, exc)
            raise AttentionVersionUnavailable(f"could not load {name}") from None

    def segment_attention(self) -> bool:
        """Attention per trajectory in packed rows: the setting, or when unset everywhere but CUDA."""
        chosen = self.cfg.segment_attention
        return self.device.type != "cuda" if chosen is None else chosen

    def layout(self) -> dict[str, Any]:
        """How this learner lays out and computes its log-probs: ``learner.logprobs.recompute``'s
        keyword arguments from the settings (the train step's, and what a bench compares with)."""
        return {
            "token_budget": self.token_budget,
            "packing": self.cfg.packing,
            "chunk": self.cfg.logprob_chunk,
            "segment_attention": self.segment_attention(),
            "keep_logits_bytes": kept_logits_bytes(self.cfg),
        }

    def compute_dtype(self) -> torch.dtype | None:
        """bf16 when ``mixed_precision`` asks for it ("auto": on CUDA), else None (float32)."""
        mode = self.cfg.mixed_precision
        return torch.bfloat16 if mode == "bf16" or (mode == "auto" and self.device.type == "cuda") else None

    # ------------------------------------------------------------------ model I/O
    def _load(self, latest: PolicyVersion | None, base_path: Path) -> Any:
        if self.cfg.lora_rank > 0:
            try:
                from peft import LoraConfig, PeftModel, get_peft_model
            except ImportError as exc:  # optional dependency
                raise RuntimeError("lora_rank > 0 needs the 'peft' package (pip install peft)") from exc
            base = _load_causal_lm(base_path, self.cfg.dtype, self.device.type)
            if latest is not None:
                adapter = Path(latest.path) / ADAPTER_DIR if latest.kind == "full" else Path(latest.path)
                return PeftModel.from_pretrained(base, str(adapter), is_trainable=True)
            lcfg = LoraConfig(
                r=self.cfg.lora_rank,
                lora_alpha=self.cfg.lora_alpha,
                target_modules=lora_targets(  # per architecture (Phi3's fused qkv_proj)
                    base.config.model_type,
                    [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)],
                    list(self.cfg.lora_targets),
                ),
                task_type="CAUSAL_LM",
            )
            return get_peft_model(base, lcfg)
        path = Path(latest.path) if latest is not None else base_path
        return _load_causal_lm(path, self.cfg.dtype, self.device.type)

    def reference_model(self) -> Any:
        """pi_ref for the KL term: the base model, frozen (loaded on first use)."""
        if self._ref is None:
            with MODEL_LOADS:
                self._ref = _load_causal_lm(self.base_path, self.cfg.dtype, self.device.type)
            self._ref = self._ref.to(self.device).eval()
            for p in self._ref.parameters():
                p.requires_grad_(False)
        return self._ref

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: TrainBatch) -> StepResult:
        """One optimizer step per batch, read top to bottom: advantages, the passes (PPO's epochs:
        recompute log-probs, loss, backward, clip, AdamW), then the new version is published."""
        self.ranks.share_batch(batch)  # rank 0: the helper ranks train the same batch
        self._switch(batch.lineage)
        # a redelivery is a step this lineage has published already: (lineage, step), never the step alone
        if self.record is not None and self.record.meta.get("step") == batch.step:
            return self._replayed(batch, self.record)
        t0 = time.perf_counter()
        check_vocabulary(
            self.model,
            (t.prompt_ids + t.completion_ids for g in batch.groups for t in g.trajectories),
        )
        assigned = assign_batch(batch, drop_zero=self.cfg.drop_zero)
        metrics = assigned.metrics()
        if not assigned.samples:
            return self._skipped(batch, metrics)
        lr = warmup_lr(batch.loss.lr, batch.loss.warmup_steps, self.version - self.state.base_version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        passes = self._passes(assigned.samples, batch, metrics)
        if passes.done == 0:
            return self._skipped(batch, metrics)
        stats = passes.merged(batch.loss.updates_per_batch, metrics)
        elapsed = time.perf_counter() - t0
        n_tokens = int(stats.pop("n_tokens"))
        metrics.update(stats)
        metrics.update(
            {
                "grad_norm": passes.grad_norm,
                "lr": lr,
                "train_seconds": elapsed,
                "tokens_per_s": stats["seq_tokens"] / elapsed if elapsed > 0 else 0.0,
                "trained_tokens_per_s": n_tokens / elapsed if elapsed > 0 else 0.0,
            }
        )
        lineage = {} if batch.lineage is None else {"lineage": batch.lineage.model_dump(mode="json")}
        record = self.publish({"step": batch.step, "metrics": metrics, "n_tokens": n_tokens, **lineage})
        return StepResult(
            step=batch.step, policy_version=record.version, metrics=metrics, n_tokens=n_tokens, policy=record
        )

    def _replayed(self, batch: TrainBatch, record: PolicyVersion) -> StepResult:
        """A redelivered batch whose step is already published: the stored result."""
        stored = record.meta
        return StepResult(
            step=batch.step,
            policy_version=self.version,
            metrics={**stored.get("metrics", {}), "replayed": 1.0},
            n_tokens=int(stored.get("n_tokens", 0)),
            policy=record,
        )

    def _skipped(self, batch: TrainBatch, metrics: dict[str, float]) -> StepResult:
        """No update (no sample with signal, or no pass applied): the policy stays."""
        metrics["skipped"] = 1.0
        return StepResult(step=batch.step, policy_version=self.version, metrics=metrics, policy=self.record)

    def _passes(
        self, samples: Sequence[TokenAdvantages], batch: TrainBatch, metrics: dict[str, float]
    ) -> Passes:
        """``updates_per_batch`` optimizer steps on the batch; a non-finite gradient ends them."""
        # rows without usable behaviour log-probs: the first pass's own log-probs stand in for them
        # on every pass, so later passes are clipped against the policy that started the batch
        first_pass_logp: dict[int, Tensor] = {}
        passes = Passes()
        for update in range(batch.loss.updates_per_batch):
            # pass k > 0 sees the policy moved by the earlier passes: the ratio to the behaviour
            # log-probs is no longer 1 there, and the clip bounds how far the batch pulls it
            stats = self.accumulate_gradients(samples, batch, first_pass_logp)
            grad_norm = self._optimizer_step(batch.loss.max_grad_norm)
            if grad_norm is None:
                metrics["nonfinite_grad"] = 1.0
                log.error("step %s pass %d: non-finite gradient norm, pass skipped", batch.step, update)
                break
            passes.applied(stats, grad_norm)
        return passes

    def accumulate_gradients(
        self,
        samples: Sequence[TokenAdvantages],
        batch: TrainBatch,
        first_pass_logp: dict[int, Tensor] | None = None,
    ) -> dict[str, float]:
        """Forward + loss + backward per micro-batch; the loss of each micro-batch is normalised by
        the whole batch's token / sequence counts, so the accumulated gradient is the batch gradient.

        A row without usable behaviour log-probs is clipped against ``first_pass_logp[i]`` (its
        log-probs on the first pass, recorded there): ratio 1 on the first pass, a real trust region
        on later ones."""
        frozen: dict[int, Tensor] = {} if first_pass_logp is None else first_pass_logp
        spec = batch.loss
        samples = self.ranks.share(samples)
        trajs = [s.trajectory for s in samples]
        lengths = [len(t.prompt_ids) + len(t.completion_ids) for t in trajs]
        # the normalisers of the WHOLE batch (every rank's share), before any backward
        n_tokens, n_seqs = self.ranks.all_sum([float(sum(sum(s.mask) for s in samples)), float(len(samples))])
        micro = lp.micro_batches(lengths, self.token_budget, packing=self.cfg.packing)
        idle = self.ranks.extra_passes(len(micro))
        totals = PassTotals(n_tokens=n_tokens, n_seqs=n_seqs)
        ref = self.reference_model() if spec.kl_coef > 0 else None
        if trajs:  # a rank may have no share of a small batch: it adds zero gradients
            self.ranks.forward_backward(
                lp.recompute,
                self.model,
                trajs,
                **self.layout(),
                with_entropy=spec.entropy_coef != 0.0,
                autocast_dtype=self.ranks.autocast(self.compute_dtype()),
                each=functools.partial(self._backward, samples, batch, frozen, totals, ref),
                temperature=spec.temperature,
            )
        self.ranks.idle_passes(self.model, idle)  # as many forward/backward passes as the busiest rank
        seq_tokens = int(totals.reduce(self.ranks, sum(lengths)))
        return totals.summary(seq_tokens, with_entropy=spec.entropy_coef != 0.0, with_kl=spec.kl_coef != 0)

    def _backward(
        self,
        samples: Sequence[TokenAdvantages],
        batch: TrainBatch,
        frozen: dict[int, Tensor],
        totals: PassTotals,
        ref: Any,
        mb: lp.MicroBatchOut,
    ) -> None:
        """The loss of one recomputed micro-batch, its backward, and its statistics in ``totals``."""
        spec = batch.loss
        rows = [samples[i] for i in mb.index]
        mask = pad_rows([s.mask for s in rows], mb.logp.shape[1], mb.logp.device)
        tis_on = spec.tis != "off"
        old, behaviour, known = old_logprobs(mb, rows, frozen, spec.temperature, decoupled=tis_on)
        # the mismatch is taken on the first pass, where the recomputed log-probs are pi_old's
        totals.add_mismatch(mb.logp.detach(), behaviour, mask, known, rows)
        is_weight = None
        if tis_on:
            is_weight = totals.add_tis(old, behaviour, mask, known, spec.tis, spec.tis_cap)
        ref_logp = None
        if ref is not None:
            with torch.no_grad():
                ref_logp, _, _ = lp.completion_logprobs(
                    ref,
                    [lp.layout_of(s.trajectory) for s in rows],
                    rows=mb.rows,
                    chunk=self.cfg.logprob_chunk,
                    segment_attention=self.segment_attention(),
                    autocast_dtype=self.compute_dtype(),
                    temperature=spec.temperature,
                )
        parts = micro_batch_loss(mb, rows, old, mask, ref_logp, batch, totals, is_weight)
        parts.loss.backward()
        totals.add_loss(parts, mask)

    def _optimizer_step(self, max_grad_norm: float) -> float | None:
        """Clip the accumulated gradient and step; None (nothing applied) when its norm is not finite."""
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.ranks.sum_gradients(trained)  # each rank's loss has the global normaliser
        # FSDP: the gradients are summed shards (DTensors); the clip takes the global norm over them
        grad_norm = collective(torch.nn.utils.clip_grad_norm_, trained, max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        # a NaN/inf gradient would write NaN into every weight: that pass is not applied
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm) if torch.isfinite(grad_norm) else None

    # ------------------------------------------------------------------ publishing
    def publish(self, meta: dict[str, Any]) -> PolicyVersion:
        """The next version: rank 0 writes it, the other ranks read its record back."""
        self._gathered = self.ranks.gather(self.model, self.optimizer, self.cfg.save_optimizer)
        try:
            record = self.ranks.publish(
                lambda: self._publish(meta), self.store, self.version + 1, self.model, self.optimizer
            )
        finally:
            self._gathered = None
        self.state.version, self.state.record = record.version, record
        return record

    def _publish(self, meta: dict[str, Any]) -> PolicyVersion:
        lora = self.cfg.lora_rank > 0 and not self.cfg.lora_merge
        kind: Literal["full", "lora"] = "lora" if lora else "full"
        record = self.store.publish(
            self.version + 1,
            self._write,
            kind=kind,
            meta={"base": str(self.state.base_path), "base_version": self.state.base_version, **meta},
        )
        if self.cfg.keep_versions > 0:
            self.store.prune(self.cfg.keep_versions)
        return record

    def _write(self, out: Path) -> None:
        if self._gathered is not None:  # FSDP: the state dicts every rank gathered for rank 0
            model_sd, optim_sd = self._gathered
            self.model.save_pretrained(str(out), state_dict=model_sd, safe_serialization=True)
            _copy_tokenizer(self.state.base_path, out)
            if optim_sd is not None:
                torch.save(optim_sd, out / OPTIMIZER_FILE)
            return
        if self.cfg.lora_rank > 0 and self.cfg.lora_merge:
            self.model.save_pretrained(str(out / ADAPTER_DIR), safe_serialization=True)
            merged = copy.deepcopy(self.model).merge_and_unload()
            merged.save_pretrained(str(out), safe_serialization=True)
            del merged
        else:
            self.model.save_pretrained(str(out), safe_serialization=True)
        _copy_tokenizer(self.state.base_path, out)
        if self.cfg.save_optimizer:
            torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)


def compile_layers(model: Any, backend: str) -> None:
    """``torch.compile`` each decoder layer (the classes the HF model names in ``_no_split_modules``) in
    place, with dynamic shapes: packed micro-batches change width from one to the next. The head and
    the packing stay eager (the fused head is an autograd function of its own)."""
    layers = set(getattr(model, "_no_split_modules", None) or ())
    compiled = 0
    for module in model.modules():
        if type(module).__name__ in layers:
            module.compile(backend=backend, dynamic=True)
            compiled += 1
    if compiled == 0:
        raise ValueError(f"torch_compile={backend!r}: the model names no decoder layers (_no_split_modules)")


def micro_batch_budget(model: Any, cfg: LearnerSettings, compute_dtype: torch.dtype | None) -> int:
    """The micro-batch token budget: ``token_budget``, or with ``memory_budget_mib`` the tokens that
    budget allows for this model (``lp.budget_tokens``)."""
    if cfg.memory_budget_mib <= 0:
        return cfg.token_budget
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return lp.budget_tokens(
        model.config,
        cfg.memory_budget_mib * 2**20,
        trainable=trainable,
        frozen=frozen,
        compute_bytes=2 if compute_dtype is not None else 4,
        checkpointing=cfg.activation_checkpointing,
        chunk=cfg.logprob_chunk or 0,
        kept_logits=kept_logits_bytes(cfg),
    )


def kept_logits_bytes(cfg: LearnerSettings) -> int:
    """The most float32 logits bytes the fused head keeps for backward (``logprob_keep_mib``); with a
    ``memory_budget_mib``, at most an eighth of it (``micro_batch_budget`` reserves them)."""
    if cfg.logprob_chunk <= 0:
        return 0
    keep = cfg.logprob_keep_mib * 2**20
    return min(keep, cfg.memory_budget_mib * 2**20 // 8) if cfg.memory_budget_mib > 0 else keep


def check_vocabulary(model: Any, sequences: Iterable[Sequence[int]]) -> None:
    """ValueError (a 422 at the API, never a crash in the embedding lookup) for a token id outside
    the model's vocabulary, or a sequence longer than its context (``max_position_embeddings``). On
    CUDA either would be a device-side assert that leaves the learner's CUDA context unusable."""
    size = int(model.get_input_embeddings().num_embeddings)
    context = getattr(model.config, "max_position_embeddings", None)
    for ids in sequences:
        if (i := outside_vocabulary(ids, size)) is not None:
            raise ValueError(f"token id {ids[i]} is outside the model's vocabulary [0, {size})")
        if context is not None and len(ids) > int(context):
            raise ValueError(f"a sequence of {len(ids)} tokens is longer than the model's context {context}")


def warmup_lr(lr: float, warmup_steps: int, steps_done: int) -> float:
    """Linear warmup: the k-th optimizer step (k = steps_done + 1) uses lr * min(1, k / warmup_steps)."""
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (steps_done + 1) / warmup_steps)


@dataclass
class Passes:
    """The passes applied to one batch: the first's and the last's statistics, the last's grad norm."""

    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    grad_norm: float = 0.0
    done: int = 0

    def applied(self, stats: dict[str, float], grad_norm: float) -> None:
        if self.done == 0:
            self.first = stats
        self.last, self.grad_norm = stats, grad_norm
        self.done += 1

    def merged(self, updates_per_batch: int, metrics: dict[str, float]) -> dict[str, float]:
        """The last pass's statistics; with several passes the log-prob mismatch is the first's (the
        behaviour policy against the policy that started the batch) and ``metrics`` gets the counts."""
        if updates_per_batch == 1:
            return self.last
        metrics["updates"] = float(self.done)
        metrics["first_pass_loss"] = self.first["loss"]
        metrics["last_pass_clip_frac"] = self.last["clip_frac"]
        first = {k: v for k, v in self.first.items() if k.startswith(FIRST_PASS_METRICS)}
        return {**self.last, **first}


@dataclass
class PassTotals:
    """Running sums of one pass over its micro-batches; ``summary`` turns them into the metrics."""

    n_tokens: float  # trained tokens of the whole batch (the loss normaliser)
    n_seqs: float
    loss: float = 0.0
    clip_frac: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    mismatch_abs: float = 0.0
    mismatch_max: float = 0.0
    mismatch_k3: float = 0.0
    mismatch_n: float = 0.0
    behaviour_rows: float = 0.0
    unmatched_rows: float = 0.0
    adv_abs: float = 0.0
    log_ratios: list[Tensor] = field(default_factory=list)  # log pi_old - log pi_behaviour per token
    tis_weight: float = 0.0
    tis_truncated: float = 0.0
    tis_n: float = 0.0
    tis: bool = False

    def add_mismatch(
        self, logp: Tensor, old: Tensor, mask: Tensor, known: list[bool], rows: Sequence[TokenAdvantages]
    ) -> None:
        """|recomputed - behaviour| log-prob statistics over the rows whose behaviour log-probs count."""
        self.unmatched_rows += float(sum(s.trajectory.logprobs is not None for s in rows) - sum(known))
        k = torch.tensor(known, device=logp.device, dtype=torch.bool)[:, None]
        self.log_ratios.append(mismatch_log_ratio(logp, old, mask * k).cpu())
        d = (logp - old) * mask * k
        self.mismatch_abs += float(d.abs().sum())
        self.mismatch_max = max(self.mismatch_max, float(d.abs().max()) if d.numel() else 0.0)
        self.mismatch_k3 += float(((torch.exp(d) - d - 1.0) * mask * k).sum())
        self.mismatch_n += float((mask * k).sum())
        self.behaviour_rows += float(sum(known))

    def add_tis(
        self, old: Tensor, behaviour: Tensor, mask: Tensor, known: list[bool], level: TisLevel, cap: float
    ) -> Tensor:
        """The TIS weights of a micro-batch (learner/mismatch.py), counted for ``tis_weight_mean``
        and ``tis_truncated_frac`` over the tokens whose behaviour log-probs count."""
        k = torch.tensor(known, device=old.device, dtype=torch.bool)
        counted = mask * k[:, None]
        raw = tis_weights(old, behaviour, counted, level, math.inf)
        weights = weights_or_one(torch.clamp(raw, max=cap), k) * mask
        self.tis = True
        self.tis_weight += float((weights * counted).sum())
        self.tis_truncated += float(((raw > cap).float() * counted).sum())
        self.tis_n += float(counted.sum())
        return weights

    def add_loss(self, parts: LossParts, mask: Tensor) -> None:
        share = float(mask.sum()) / max(self.n_tokens, 1.0)
        self.loss += float(parts.loss.detach())
        self.clip_frac += float(parts.clip_frac) * share
        self.kl += float(parts.kl) * share
        self.entropy += float(parts.entropy) * share

    def reduce(self, ranks: OneProcess, seq_tokens: int) -> float:
        """The sums over every rank's share (the token-ratio percentiles stay this rank's; one
        process: its own); returns the summed ``seq_tokens``."""
        names = (
            "loss", "clip_frac", "kl", "entropy", "mismatch_abs", "mismatch_k3", "mismatch_n",
            "behaviour_rows", "unmatched_rows", "adv_abs", "tis_weight", "tis_truncated", "tis_n",
        )  # fmt: skip
        summed = ranks.all_sum([getattr(self, n) for n in names] + [float(seq_tokens)])
        for n, v in zip(names, summed, strict=False):
            setattr(self, n, v)
        self.mismatch_max = ranks.all_max([self.mismatch_max])[0]
        return summed[-1]

    def summary(self, seq_tokens: int, *, with_entropy: bool, with_kl: bool) -> dict[str, float]:
        n = max(self.mismatch_n, 1.0)
        out = {"loss": self.loss, "clip_frac": self.clip_frac, "kl": self.kl, "entropy": self.entropy}
        out.update(
            {
                "logprob_mismatch_mean": self.mismatch_abs / n,
                "logprob_mismatch_max": self.mismatch_max,
                "logprob_mismatch_k3": self.mismatch_k3 / n,
                "behaviour_logprobs_used": self.behaviour_rows / max(self.n_seqs, 1.0),
                # rows whose behaviour log-probs are of another processing (raw at T != 1, another
                # temperature, top-p/top-k, unknown): clipped against the first pass instead
                "behaviour_logprobs_unmatched": self.unmatched_rows / max(self.n_seqs, 1.0),
                "adv_abs_mean": self.adv_abs / max(self.n_tokens, 1.0),
                "n_tokens": self.n_tokens,
                "seq_tokens": float(seq_tokens),
            }
        )
        log_ratio = torch.cat(self.log_ratios) if self.log_ratios else torch.zeros(0)
        p05, p50, p95 = ratio_percentiles(log_ratio)
        out.update(
            {
                # KL(pi_behaviour || pi_old) on the behaviour's samples, k1 and k3 estimators
                "mismatch_kl_k1": kl_k1(log_ratio),
                "mismatch_kl_k3": kl_k3(log_ratio),
                # r = pi_old / pi_behaviour per token
                "mismatch_ratio_p05": p05,
                "mismatch_ratio_p50": p50,
                "mismatch_ratio_p95": p95,
            }
        )
        if self.tis:
            out["tis_weight_mean"] = self.tis_weight / max(self.tis_n, 1.0)
            out["tis_truncated_frac"] = self.tis_truncated / max(self.tis_n, 1.0)
        if not with_entropy:
            out.pop("entropy")
        if not with_kl:
            out.pop("kl")
        return {k: (v if math.isfinite(v) else 0.0) for k, v in out.items()}


def old_logprobs(
    mb: lp.MicroBatchOut,
    rows: Sequence[TokenAdvantages],
    frozen: dict[int, Tensor],
    temperature: float,
    *,
    decoupled: bool = False,
) -> tuple[Tensor, Tensor, list[bool]]:
    """(the log-probs the ratio is taken against, the behaviour log-probs, which rows' behaviour
    log-probs count). The ratio's are the behaviour ones where they match what the learner computes
    (``lp.behaviour_matches``), else the row's first-pass log-probs (recorded in ``frozen``); with
    ``decoupled`` (TIS on) every row's are its first-pass log-probs, pi_old."""
    width, dev = mb.logp.shape[1], mb.logp.device
    known = [lp.behaviour_matches(s.trajectory, temperature) for s in rows]
    behaviour = pad_rows([s.trajectory.logprobs or [0.0] * len(s.mask) for s in rows], width, dev)
    detached = mb.logp.detach()
    stand_in = detached.clone()
    for r, i in enumerate(mb.index):
        if decoupled or not known[r]:
            n_i = len(rows[r].mask)
            if i not in frozen:
                frozen[i] = detached[r, :n_i].clone()
            stand_in[r, :n_i] = frozen[i]
    if decoupled:
        return stand_in, behaviour, known
    k = torch.tensor(known, device=dev, dtype=torch.bool)[:, None]
    return torch.where(k, behaviour, stand_in), behaviour, known


def micro_batch_loss(
    mb: lp.MicroBatchOut,
    rows: Sequence[TokenAdvantages],
    old: Tensor,
    mask: Tensor,
    ref_logp: Tensor | None,
    batch: TrainBatch,
    totals: PassTotals,
    is_weight: Tensor | None = None,
) -> LossParts:
    """-J of one micro-batch (the estimator's own loss, or the clipped policy loss), normalised by the
    whole batch's counts in ``totals``; ``is_weight``: the TIS weights (None: off)."""
    spec = batch.loss
    width, dev = mb.logp.shape[1], mb.logp.device
    adv = pad_rows([s.adv for s in rows], width, dev)
    totals.adv_abs += float((adv.abs() * mask).sum())
    common: LossTerms = {
        "eps_low": spec.eps_low,
        "eps_high": spec.eps_high,
        "ref_logp": ref_logp,
        "kl_coef": spec.kl_coef,
        "entropy": mb.entropy,
        "entropy_coef": spec.entropy_coef,
        "seq_weight": torch.tensor([s.weight for s in rows], device=dev, dtype=torch.float32),
        "n_seqs": totals.n_seqs,
        "is_weight": is_weight,
    }
    estimator_loss = estimator(batch.estimator).loss
    if estimator_loss is not None:  # the estimator's own loss shape (its module's ``loss``)
        return estimator_loss(mb.logp, old, adv, mask, rows, spec, common)
    return policy_loss(
        mb.logp, old, adv, mask, aggregation=spec.aggregation, n_tokens=totals.n_tokens, **common
    )


def _copy_tokenizer(base: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        src = base / name
        if src.exists() and not (out / name).exists():
            shutil.copy2(src, out / name)
