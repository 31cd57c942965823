"""Sequence packing, the fused chunked head, the memory-budgeted micro-batch and torch.compile: the
packed path trains exactly what the padded path trains (float32, CPU), on both layouts."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from learner import logprobs as lp
from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.train import Learner
from loom.contracts.wire import Group, LossSpec, TrainBatch

PADDED = {"packing": False, "logprob_chunk": 0}  # the learner before packing: one row each, whole logits
PACKED = {"packing": True, "logprob_chunk": 16}  # chunks far smaller than one micro-batch's tokens


def _with_group_layout(groups: list[Group]) -> list[Group]:
    """Every other trajectory in the streaming group-position layout (mixed rows)."""
    out = []
    for g in groups:
        trajs = [
            t.model_copy(update={"meta": {**t.meta, "layout": lp.GROUP_LAYOUT}}) if i % 2 else t
            for i, t in enumerate(g.trajectories)
        ]
        out.append(g.model_copy(update={"trajectories": trajs}))
    return out


def _grads(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-5) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=0) for k in a)


def test_packed_plan_keeps_every_trajectory_once_within_the_budget_with_little_padding():
    rnd = random.Random(0)
    lengths = [rnd.randint(16, 512) for _ in range(128)]
    budget = 4096
    padded = lp.plan(lengths, budget, packing=False)
    packed = lp.plan(lengths, budget, packing=True)
    width = max(lengths)
    for mbs in (padded, packed):
        assert sorted(i for mb in mbs for row in mb for i in row) == list(range(len(lengths)))
    for mb in packed:
        assert all(sum(lengths[i] for i in row) <= width for row in mb)
        assert len(mb) * max(sum(lengths[i] for i in row) for row in mb) <= budget
    real = sum(lengths)
    computed = sum(len(mb) * max(sum(lengths[i] for i in row) for row in mb) for mb in packed)
    computed_padded = sum(len(mb) * max(lengths[row[0]] for row in mb) for mb in padded)
    assert computed / real <= 1.05 < computed_padded / real
    assert lp.micro_batches(lengths, budget, packing=True) == [
        [i for row in mb for i in row] for mb in packed
    ]


@pytest.mark.parametrize("group_layout", [False, True])
@pytest.mark.parametrize(("temperature", "keep"), [(1.0, 0), (0.7, 0), (1.0, 1 << 30), (0.7, 1 << 30)])
def test_packed_chunked_logprobs_and_gradients_equal_the_padded_path(
    model_dir, batch_parts, group_layout, temperature, keep
):
    """Recomputing the head's logits in the backward (keep 0) or keeping them: the same gradients."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    groups, _ = batch_parts(n_groups=3, seed=3)
    if group_layout:
        groups = _with_group_layout(groups)
    trajs = [t for g in groups for t in g.trajectories]
    weights = torch.linspace(0.5, 2.0, len(trajs))

    def run(**kw: object) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict[str, torch.Tensor]]:
        model.zero_grad()
        outs = lp.recompute(model, trajs, with_entropy=True, temperature=temperature, **kw)  # type: ignore[arg-type]
        logp, ent, total = {}, {}, torch.zeros(())
        for mb in outs:
            assert mb.entropy is not None
            for r, i in enumerate(mb.index):
                n = len(trajs[i].completion_ids)
                assert float(mb.valid[r].sum()) == n and float(mb.valid[r, :n].sum()) == n
                logp[i], ent[i] = mb.logp[r, :n], mb.entropy[r, :n]
                total = total + weights[i] * mb.logp[r, :n].sum() + weights[-1 - i] * mb.entropy[r, :n].sum()
        total.backward()
        return logp, ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_logp, ref_ent, ref_grad = run(token_budget=10_000, packing=False, chunk=0)
    logp, ent, grad = run(token_budget=120, packing=True, chunk=16, keep_logits_bytes=keep)
    assert len(lp.plan([len(t.prompt_ids) + len(t.completion_ids) for t in trajs], 120, packing=True)) > 1
    for i in ref_logp:
        assert torch.allclose(logp[i], ref_logp[i], atol=1e-5, rtol=0)
        assert torch.allclose(ent[i], ref_ent[i], atol=1e-5, rtol=0)
    assert sum(float(g.abs().sum()) for g in ref_grad.values()) > 0
    assert _close(grad, ref_grad, atol=1e-5)


def test_the_chunked_head_keeps_no_tokens_by_vocabulary_tensor_for_backward(batch_parts):
    torch.manual_seed(0)
    # a vocabulary size no other dimension has, so a saved tensor's last dim names it
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=101,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    groups, _ = batch_parts(n_groups=2, seed=4)
    trajs = [t for g in groups for t in g.trajectories]
    vocab = model.config.vocab_size
    n_completion = sum(len(t.completion_ids) for t in trajs)

    def largest_saved_logits(**kw: object) -> int:
        """The most tokens x vocabulary elements any one tensor saved for backward holds."""
        seen = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dim() >= 2 and t.shape[-1] == vocab:
                seen[0] = max(seen[0], t.numel() // vocab)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp.recompute(model, trajs, token_budget=10_000, with_entropy=True, **kw)  # type: ignore[arg-type]
        return seen[0]

    assert largest_saved_logits(packing=False, chunk=0) >= n_completion  # the whole logits, kept
    assert largest_saved_logits(packing=True, chunk=0) >= n_completion  # packed, whole logits: kept
    # the fused head saves the hidden states and the head's weight, no logits
    assert largest_saved_logits(packing=True, chunk=8) == 0
    assert largest_saved_logits(packing=False, chunk=8) == 0
    # allowed to keep them: one chunk per saved tensor, and only while all of them fit in the bytes
    fits = n_completion * vocab * 4
    assert largest_saved_logits(packing=True, chunk=8, keep_logits_bytes=fits) == 8
    assert largest_saved_logits(packing=True, chunk=8, keep_logits_bytes=fits - 1) == 0


@pytest.mark.parametrize(
    ("estimator", "spec"),
    [
        ("grpo", LossSpec(aggregation="token_mean", entropy_coef=0.01, kl_coef=0.05)),
        ("grpo", LossSpec(aggregation="seq_mean_token_mean", tis="token")),
        ("grpo", LossSpec(aggregation="seq_mean_token_sum", updates_per_batch=2)),
        ("hrpo", LossSpec(entropy_coef=0.01)),
    ],
)
def test_a_packed_train_step_equals_the_padded_one(model_dir, tmp_path, batch_parts, estimator, spec):
    """Loss, gradients and the updated weights within 1e-5, with the group-position layout mixed in."""
    groups, rewards = batch_parts(n_groups=3, seed=8)
    batch = TrainBatch(
        step=0, groups=_with_group_layout(groups), rewards=rewards, estimator=estimator, loss=spec
    )
    samples = assign_batch(batch).samples
    learners, grads, stats = [], [], []
    for name, kw in (("padded", PADDED), ("packed", PACKED)):
        learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / name, token_budget=90, **kw))  # type: ignore[arg-type]
        stats.append(learner.accumulate_gradients(samples, batch))
        grads.append(_grads(learner))
        learner.optimizer.zero_grad(set_to_none=True)
        learners.append(learner)
    assert sum(float(g.abs().sum()) for g in grads[0].values()) > 0
    assert _close(grads[0], grads[1])
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], abs=1e-5)
    assert stats[0]["seq_tokens"] == stats[1]["seq_tokens"]
    results = [learner.train_step(batch) for learner in learners]
    assert results[0].metrics["loss"] == pytest.approx(results[1].metrics["loss"], abs=1e-5)
    weights = [{n: p.detach().clone() for n, p in x.model.named_parameters()} for x in learners]
    assert _close(weights[0], weights[1])


def test_the_memory_budget_chooses_the_micro_batch_token_budget(model_dir, tmp_path, batch_parts):
    small = Learner(LearnerSettings(model=model_dir, store=tmp_path / "a", memory_budget_mib=8))
    large = Learner(LearnerSettings(model=model_dir, store=tmp_path / "b", memory_budget_mib=64))
    fixed = Learner(LearnerSettings(model=model_dir, store=tmp_path / "c", token_budget=123))
    assert fixed.token_budget == 123
    assert 1 <= small.token_budget < large.token_budget
    per_mib = (large.token_budget - small.token_budget) / 56
    assert per_mib > 0
    # activation checkpointing keeps less per token: the same budget holds more tokens
    ckpt = Learner(
        LearnerSettings(
            model=model_dir, store=tmp_path / "d", memory_budget_mib=64, activation_checkpointing=True
        )
    )
    assert ckpt.token_budget > large.token_budget
    groups, rewards = batch_parts(n_groups=4, seed=9)
    lengths = [len(t.prompt_ids) + len(t.completion_ids) for g in groups for t in g.trajectories]
    assert len(lp.micro_batches(lengths, small.token_budget, packing=True)) >= len(
        lp.micro_batches(lengths, large.token_budget, packing=True)
    )
    result = small.train_step(TrainBatch(step=0, groups=groups, rewards=rewards))
    assert result.policy_version == 1


def test_torch_compiled_layers_train_the_same_step(model_dir, tmp_path, batch_parts):
    """torch.compile through dynamo ('eager': traced graphs, no code generation on a loaded CPU)."""
    groups, rewards = batch_parts(seed=10)
    batch = TrainBatch(step=0, groups=groups, rewards=rewards)
    weights = []
    for backend in ("off", "eager"):
        learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / backend, torch_compile=backend))
        layers = [m for m in learner.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
        assert layers and all((m._compiled_call_impl is not None) == (backend != "off") for m in layers)
        learner.train_step(batch)
        weights.append({n: p.detach().clone() for n, p in learner.model.named_parameters()})
    assert _close(weights[0], weights[1])
