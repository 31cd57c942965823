"""The train step: advantages -> recomputed log-probs -> loss -> AdamW step -> new policy version.

One ``Learner`` owns the policy: it resumes from the newest version in the policy store (weights and
optimizer state), trains one optimizer step per ``TrainBatch`` (micro-batched by a token budget,
gradients accumulated), and publishes each new version (full safetensors, or a LoRA adapter) to the
store. A batch whose step was already published (a redelivered task) returns the stored result.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from learner import logprobs as lp
from learner.assign import assign_batch
from learner.estimators import TokenAdvantages
from learner.losses import LossParts, hrpo_loss, policy_loss
from loom.batching import next_batch_size
from loom.contracts.estimators import estimator_params
from loom.schemas import LossSpec, PolicyVersion, StepResult, TrainBatch
from loom.store import PolicyStore
from loom.vocab import outside_vocabulary

log = logging.getLogger("loom.learner")

OPTIMIZER_FILE = "optimizer.pt"
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


@dataclass
class LearnerConfig:
    model: str | Path = "tiny"  # 'tiny' (loom.tiny.CHECKPOINT_DIR) or any HF causal-LM directory
    store: str | Path = ".loom/policy"
    device: str = "cpu"
    token_budget: int = 8192  # padded tokens per micro-batch
    weight_decay: float = 0.01  # AdaSR Table 9
    betas: tuple[float, float] = (0.9, 0.999)
    bf16: bool = True  # autocast to bf16 on CUDA (fp32 master weights); ignored on CPU
    lora_rank: int = 0  # > 0: train a LoRA adapter (needs peft) and publish adapters
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    save_optimizer: bool = True
    keep_versions: int = 0  # > 0: prune older versions after publishing
    drop_zero: bool = True


def resolve_model_path(model: str | Path) -> Path:
    if str(model) == "tiny":
        from loom.tiny import CHECKPOINT_DIR

        return Path(CHECKPOINT_DIR)
    return Path(model)


def _load_causal_lm(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


class Learner:
    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.store = PolicyStore(cfg.store)
        self.base_path = resolve_model_path(cfg.model)
        self.device = torch.device(cfg.device)
        latest = self.store.latest()
        self.model = self._load(latest)
        self.model.to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=LossSpec().lr,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.version = latest.version if latest else 0
        self.record = latest
        if latest is not None and (Path(latest.path) / OPTIMIZER_FILE).exists():
            state = torch.load(
                Path(latest.path) / OPTIMIZER_FILE, map_location=self.device, weights_only=True
            )
            self.optimizer.load_state_dict(state)
        self._ref: Any = None
        if latest is not None:
            log.info("learner resumed from policy version %d (%s)", latest.version, latest.path)

    # ------------------------------------------------------------------ model I/O
    def _load(self, latest: PolicyVersion | None) -> Any:
        if self.cfg.lora_rank > 0:
            try:
                from peft import LoraConfig, PeftModel, get_peft_model
            except ImportError as exc:  # optional dependency
                raise RuntimeError("lora_rank > 0 needs the 'peft' package (pip install peft)") from exc
            base = _load_causal_lm(self.base_path)
            if latest is not None:
                return PeftModel.from_pretrained(base, latest.path, is_trainable=True)
            lcfg = LoraConfig(
                r=self.cfg.lora_rank,
                lora_alpha=self.cfg.lora_alpha,
                target_modules=list(self.cfg.lora_targets),
                task_type="CAUSAL_LM",
            )
            return get_peft_model(base, lcfg)
        return _load_causal_lm(Path(latest.path) if latest is not None else self.base_path)

    def reference_model(self) -> Any:
        """pi_ref for the KL term: the base model, frozen (loaded on first use)."""
        if self._ref is None:
            self._ref = _load_causal_lm(self.base_path).to(self.device).eval()
            for p in self._ref.parameters():
                p.requires_grad_(False)
        return self._ref

    def _write(self, out: Path) -> None:
        self.model.save_pretrained(str(out), safe_serialization=True)
        for name in TOKENIZER_FILES:
            src = self.base_path / name
            if src.exists() and not (out / name).exists():
                shutil.copy2(src, out / name)
        if self.cfg.save_optimizer:
            torch.save(self.optimizer.state_dict(), out / OPTIMIZER_FILE)

    def publish(self, meta: dict[str, Any]) -> PolicyVersion:
        kind: Literal["full", "lora"] = "lora" if self.cfg.lora_rank > 0 else "full"
        record = self.store.publish(
            self.version + 1, self._write, kind=kind, meta={"base": str(self.base_path), **meta}
        )
        self.version = record.version
        self.record = record
        if self.cfg.keep_versions > 0:
            self.store.prune(self.cfg.keep_versions)
        return record

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: TrainBatch) -> StepResult:
        if self.record is not None and self.record.meta.get("step") == batch.step:
            stored = self.record.meta
            return StepResult(
                step=batch.step,
                policy_version=self.version,
                metrics={**stored.get("metrics", {}), "replayed": 1.0},
                n_tokens=int(stored.get("n_tokens", 0)),
                policy=self.record,
            )
        t0 = time.perf_counter()
        check_vocabulary(
            self.model,
            (t.prompt_ids + t.completion_ids for g in batch.groups for t in g.trajectories),
        )
        assigned = assign_batch(batch, drop_zero=self.cfg.drop_zero)
        metrics: dict[str, float] = {
            "groups": float(assigned.n_groups),
            "valid_groups": float(assigned.n_valid_groups),
            "dropped_zero_adv": float(assigned.n_dropped),
            "samples": float(len(assigned.samples)),
        }
        params = estimator_params(batch.estimator, batch.estimator_params)
        if params.batch_size is not None and params.target_groups is not None:
            metrics["next_batch_size"] = float(
                next_batch_size(
                    params.batch_size, params.target_groups, assigned.n_valid_groups, lam=params.batch_lambda
                )
            )
        if not assigned.samples:
            metrics["skipped"] = 1.0
            return StepResult(
                step=batch.step, policy_version=self.version, metrics=metrics, policy=self.record
            )

        spec = batch.loss
        lr = warmup_lr(spec.lr, spec.warmup_steps, self.version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        first: dict[str, float] = {}
        # rows without usable behaviour log-probs: the first pass's own log-probs stand in for them
        # on every pass, so later passes are clipped against the policy that started the batch
        first_pass_logp: dict[int, Tensor] = {}
        done = 0
        applied: dict[str, float] = {}
        applied_norm = 0.0
        for update in range(spec.updates_per_batch):
            # pass k > 0 sees the policy moved by the earlier passes: the ratio to the behaviour
            # log-probs is no longer 1 there, and the clip bounds how far the batch pulls it
            stats = self.accumulate_gradients(assigned.samples, batch, first_pass_logp)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], spec.max_grad_norm
            )
            if not torch.isfinite(grad_norm):
                # a NaN/inf gradient would write NaN into every weight: this pass is not applied
                self.optimizer.zero_grad(set_to_none=True)
                metrics["nonfinite_grad"] = 1.0
                log.error("step %s pass %d: non-finite gradient norm, pass skipped", batch.step, update)
                break
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            done += 1
            applied, applied_norm = stats, float(grad_norm)
            if update == 0:
                first = stats
        if done == 0:
            metrics["skipped"] = 1.0
            return StepResult(
                step=batch.step, policy_version=self.version, metrics=metrics, policy=self.record
            )
        stats = applied
        if spec.updates_per_batch > 1:
            metrics["updates"] = float(done)
            metrics["first_pass_loss"] = first["loss"]
            metrics["last_pass_clip_frac"] = stats["clip_frac"]
            stats = {
                **stats,
                "logprob_mismatch_mean": first["logprob_mismatch_mean"],
                "logprob_mismatch_max": first["logprob_mismatch_max"],
                "logprob_mismatch_k3": first["logprob_mismatch_k3"],
            }
        elapsed = time.perf_counter() - t0
        n_tokens = int(stats.pop("n_tokens"))
        metrics.update(stats)
        metrics.update(
            {
                "grad_norm": applied_norm,
                "lr": lr,
                "train_seconds": elapsed,
                "tokens_per_s": stats["seq_tokens"] / elapsed if elapsed > 0 else 0.0,
                "trained_tokens_per_s": n_tokens / elapsed if elapsed > 0 else 0.0,
            }
        )
        record = self.publish({"step": batch.step, "metrics": metrics, "n_tokens": n_tokens})
        return StepResult(
            step=batch.step, policy_version=record.version, metrics=metrics, n_tokens=n_tokens, policy=record
        )

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
        hrpo = batch.estimator == "hrpo"
        trajs = [s.trajectory for s in samples]
        n_tokens = float(sum(sum(s.mask) for s in samples))
        n_seqs = float(len(samples))
        want_entropy = spec.entropy_coef != 0.0
        autocast = torch.bfloat16 if (self.device.type == "cuda" and self.cfg.bf16) else None
        ref = self.reference_model() if spec.kl_coef > 0 else None
        totals = {"loss": 0.0, "clip_frac": 0.0, "kl": 0.0, "entropy": 0.0}
        mism = {"d_abs": 0.0, "d_max": 0.0, "k3": 0.0, "n": 0.0, "rows": 0.0, "unmatched": 0.0}
        adv_abs = 0.0
        all_seq_lens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in trajs)

        def consume(mb: lp.MicroBatchOut) -> None:
            nonlocal adv_abs
            rows = [samples[i] for i in mb.index]
            width = mb.logp.shape[1]
            dev = mb.logp.device
            mask = _pad([s.mask for s in rows], width, dev)
            behaviour_known = [lp.behaviour_matches(s.trajectory, spec.temperature) for s in rows]
            mism["unmatched"] += float(
                sum(s.trajectory.logprobs is not None for s in rows) - sum(behaviour_known)
            )
            old = _pad([s.trajectory.logprobs or [0.0] * len(s.mask) for s in rows], width, dev)
            detached = mb.logp.detach()
            stand_in = detached.clone()
            for r, i in enumerate(mb.index):
                if not behaviour_known[r]:
                    n_i = len(samples[i].mask)
                    if i not in frozen:
                        frozen[i] = detached[r, :n_i].clone()
                    stand_in[r, :n_i] = frozen[i]
            known = torch.tensor(behaviour_known, device=dev, dtype=torch.bool)[:, None]
            old = torch.where(known, old, stand_in)
            d = (detached - old) * mask * known
            mism["d_abs"] += float(d.abs().sum())
            mism["d_max"] = max(mism["d_max"], float(d.abs().max()) if d.numel() else 0.0)
            mism["k3"] += float(((torch.exp(d) - d - 1.0) * mask * known).sum())
            mism["n"] += float((mask * known).sum())
            mism["rows"] += float(sum(behaviour_known))
            ref_logp = None
            if ref is not None:
                with torch.no_grad():
                    ref_logp, _, _ = lp.completion_logprobs(
                        ref,
                        [lp.layout_of(s.trajectory) for s in rows],
                        autocast_dtype=autocast,
                        temperature=spec.temperature,
                    )
            weight = torch.tensor([s.weight for s in rows], device=dev, dtype=torch.float32)
            adv = _pad([s.adv for s in rows], width, dev)
            adv_abs += float((adv.abs() * mask).sum())
            parts: LossParts
            if hrpo:
                parts = hrpo_loss(
                    mb.logp,
                    old,
                    _pad([s.adv_stream or [0.0] * len(s.mask) for s in rows], width, dev),
                    _pad([s.adv_deep or [0.0] * len(s.mask) for s in rows], width, dev),
                    adv,
                    mask,
                    _pad([s.stream_mask or [0] * len(s.mask) for s in rows], width, dev),
                    lam=spec.hrpo_lambda,
                    eps_low=spec.eps_low,
                    eps_high=spec.eps_high,
                    ref_logp=ref_logp,
                    kl_coef=spec.kl_coef,
                    entropy=mb.entropy,
                    entropy_coef=spec.entropy_coef,
                    seq_weight=weight,
                    n_seqs=n_seqs,
                )
            else:
                parts = policy_loss(
                    mb.logp,
                    old,
                    adv,
                    mask,
                    eps_low=spec.eps_low,
                    eps_high=spec.eps_high,
                    aggregation=spec.aggregation,
                    ref_logp=ref_logp,
                    kl_coef=spec.kl_coef,
                    entropy=mb.entropy,
                    entropy_coef=spec.entropy_coef,
                    seq_weight=weight,
                    n_tokens=n_tokens,
                    n_seqs=n_seqs,
                )
            parts.loss.backward()
            share = float(mask.sum()) / max(n_tokens, 1.0)
            totals["loss"] += float(parts.loss.detach())
            totals["clip_frac"] += float(parts.clip_frac) * share
            totals["kl"] += float(parts.kl) * share
            totals["entropy"] += float(parts.entropy) * share

        lp.recompute(
            self.model,
            trajs,
            token_budget=self.cfg.token_budget,
            with_entropy=want_entropy,
            autocast_dtype=autocast,
            each=consume,
            temperature=spec.temperature,
        )
        n = max(mism["n"], 1.0)
        out = dict(totals)
        out.update(
            {
                "logprob_mismatch_mean": mism["d_abs"] / n,
                "logprob_mismatch_max": mism["d_max"],
                "logprob_mismatch_k3": mism["k3"] / n,
                "behaviour_logprobs_used": mism["rows"] / max(n_seqs, 1.0),
                # rows whose behaviour log-probs are of another processing (raw at T != 1, another
                # temperature, top-p/top-k, unknown): clipped against the first pass instead
                "behaviour_logprobs_unmatched": mism["unmatched"] / max(n_seqs, 1.0),
                "adv_abs_mean": adv_abs / max(n_tokens, 1.0),
                "n_tokens": n_tokens,
                "seq_tokens": float(all_seq_lens),
            }
        )
        if not want_entropy:
            out.pop("entropy")
        if spec.kl_coef == 0:
            out.pop("kl")
        return {k: (v if math.isfinite(v) else 0.0) for k, v in out.items()}


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


def _pad(rows: Sequence[Sequence[float]], width: int, device: Any) -> Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for r, xs in enumerate(rows):
        if xs:
            out[r, : len(xs)] = torch.tensor(list(xs), dtype=torch.float32)
    return out.to(device)


def warmup_lr(lr: float, warmup_steps: int, steps_done: int) -> float:
    """Linear warmup: the k-th optimizer step (k = steps_done + 1) uses lr * min(1, k / warmup_steps)."""
    if warmup_steps <= 0:
        return lr
    return lr * min(1.0, (steps_done + 1) / warmup_steps)
