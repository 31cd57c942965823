"""Rollout-train mismatch and TIS (learner/mismatch.py, docs/algorithms.md §5.2): the formulas on
hand-computed cases, and the train step's TIS against the ratio-to-behaviour update it replaces."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from learner import logprobs as lp
from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.losses import hrpo_loss, policy_loss
from learner.mismatch import kl_k1, kl_k3, mismatch_log_ratio, ratio_percentiles, tis_weights, weights_or_one
from learner.train import Learner
from loom.contracts.wire import LossSpec, TrainBatch
from loom.store import PolicyStore

L = math.log


def test_token_tis_truncates_each_token_ratio_at_the_cap():
    old = torch.tensor([[L(0.5), L(0.9), L(0.2)]])
    behaviour = torch.tensor([[L(0.25), L(0.9), L(0.4)]])  # ratios 2.0, 1.0, 0.5
    mask = torch.ones(1, 3)
    w = tis_weights(old, behaviour, mask, "token", cap=1.5)
    assert w[0].tolist() == pytest.approx([1.5, 1.0, 0.5])


def test_sequence_tis_is_one_truncated_product_per_sequence_over_its_trained_tokens():
    old = torch.tensor([[L(0.5), L(0.3), L(0.6)], [L(0.1), L(0.1), L(0.1)]])
    behaviour = torch.tensor([[L(0.25), L(0.4), L(0.01)], [L(0.2), L(0.1), L(0.1)]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the third token is not trained
    w = tis_weights(old, behaviour, mask, "sequence", cap=2.0)
    # row 0: 2.0 * 0.75 = 1.5 (the untrained token's ratio 60 does not enter); row 1: 0.5
    assert w.flatten().tolist() == pytest.approx([1.5, 1.5, 0.0, 0.5, 0.5, 0.0])
    assert tis_weights(old, behaviour, mask, "sequence", cap=1.2)[0, 0].item() == pytest.approx(1.2)


def test_rows_without_usable_behaviour_logprobs_get_weight_one():
    w = torch.tensor([[0.3, 0.4], [0.5, 0.6]])
    out = weights_or_one(w, torch.tensor([True, False]))
    assert out.flatten().tolist() == pytest.approx([0.3, 0.4, 1.0, 1.0])


def test_mismatch_kl_estimators_and_ratio_percentiles_by_hand():
    old = torch.tensor([[L(0.5), L(0.2), L(0.7)]])
    behaviour = torch.tensor([[L(0.25), L(0.4), L(0.1)]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    log_ratio = mismatch_log_ratio(old, behaviour, mask)  # r = 2, 0.5 (the masked token is out)
    assert log_ratio.tolist() == pytest.approx([L(2.0), L(0.5)])
    assert kl_k1(log_ratio) == pytest.approx(0.0, abs=1e-7)  # -(log 2 + log 0.5) / 2
    assert kl_k3(log_ratio) == pytest.approx(((2 - 1 - L(2)) + (0.5 - 1 - L(0.5))) / 2)  # = 0.25
    assert ratio_percentiles(log_ratio, (0.0, 0.5, 1.0)) == pytest.approx([0.5, 1.25, 2.0])


def test_policy_loss_weights_each_tokens_surrogate_and_not_the_kl():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)
    w = torch.tensor([[1.5, 0.5]])
    parts = policy_loss(logp, logp.detach(), adv, mask, is_weight=w)  # r = 1: C = A
    assert parts.loss.item() == pytest.approx(-(1.5 * 1.0 + 0.5 * -1.0) / 2)
    parts.loss.backward()
    assert logp.grad is not None
    assert logp.grad.flatten().tolist() == pytest.approx([-0.75, 0.25])  # -w A / n
    ref = torch.tensor([[-1.5, -2.5]])
    with_kl = policy_loss(logp, logp.detach(), adv, mask, is_weight=w, ref_logp=ref, kl_coef=0.1)
    k3 = (torch.exp(ref - logp) - (ref - logp) - 1).mean().item()
    assert with_kl.loss.item() == pytest.approx(parts.loss.item() + 0.1 * k3)


def test_hrpo_loss_weights_all_three_surrogates():
    torch.manual_seed(0)
    logp = torch.randn(2, 5)
    advs = [torch.randn(2, 5) for _ in range(3)]
    mask = torch.ones(2, 5)
    stream = torch.tensor([[1.0, 1.0, 0, 0, 0], [1.0, 0, 0, 0, 0]])
    base = hrpo_loss(logp, logp, *advs, mask, stream, lam=0.5).loss
    weighted = hrpo_loss(logp, logp, *advs, mask, stream, lam=0.5, is_weight=torch.full((2, 5), 0.3)).loss
    assert weighted.item() == pytest.approx(0.3 * base.item(), rel=1e-6)


def _with_behaviour_near_learner(model_dir, store, batch_parts, offset):
    """A batch whose behaviour log-probs are the learner's own plus ``offset(i)`` per token."""
    groups, rewards = batch_parts(streaming=False, seed=3)
    model = Learner(LearnerSettings(model=model_dir, store=store)).model
    trajs = [t for g in groups for t in g.trajectories]
    own, _, _ = lp.completion_logprobs(model, [lp.layout_of(t) for t in trajs])
    for r, t in enumerate(trajs):
        n = len(t.completion_ids)
        t.logprobs = [float(own[r, j].detach()) + offset(j) for j in range(n)]
    return groups, rewards


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_with_a_high_cap_gives_the_ratio_to_behaviour_gradient(model_dir, tmp_path, batch_parts, level):
    # inside the clip range, d/dtheta min(r A, clip(r) A) with r = pi/pi_b is (pi_old/pi_b) A grad log pi:
    # token TIS with a cap above every weight computes the same gradient with the ratio taken to pi_old.
    # Sequence TIS weighs every token of a row by the row's product of ratios: a row whose first token
    # alone has r = e^-0.1 trains as a row whose every token has r = e^-0.1 without TIS
    if level == "token":
        offsets = {"off": lambda j: 0.05 * (-1) ** j, level: lambda j: 0.05 * (-1) ** j}
    else:
        offsets = {"off": lambda j: 0.1, level: lambda j: 0.0 if j else 0.1}
    grads, metrics = [], []
    for tis, offset in offsets.items():
        groups, rewards = _with_behaviour_near_learner(model_dir, tmp_path / "own", batch_parts, offset)
        batch = TrainBatch(step=0, groups=groups, rewards=rewards, loss=LossSpec(tis=tis, tis_cap=10.0))
        learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / tis))
        stats = learner.accumulate_gradients(assign_batch(batch).samples, batch)
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters()})
        metrics.append(stats)
    assert sum(float(g.abs().sum()) for g in grads[0].values()) > 0
    assert all(torch.allclose(grads[0][k], grads[1][k], atol=1e-6) for k in grads[0])
    assert metrics[1]["tis_truncated_frac"] == 0.0 and metrics[1]["tis_weight_mean"] != 1.0
    assert metrics[0]["clip_frac"] == 0.0  # the premise: no clipped token


def test_tis_truncation_changes_the_update_and_is_reported(model_dir, tmp_path, batch_parts):
    groups, rewards = _with_behaviour_near_learner(
        model_dir, tmp_path / "own", batch_parts, lambda j: -0.5 * (j % 2)
    )
    results = {}
    for cap in (10.0, 1.2):
        batch = TrainBatch(step=0, groups=groups, rewards=rewards, loss=LossSpec(tis="token", tis_cap=cap))
        learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / str(cap)))
        results[cap] = learner.train_step(batch).metrics
    lengths = [len(s.mask) for s in assign_batch(batch).samples]
    odd = sum(n // 2 for n in lengths) / sum(lengths)  # the tokens with r = e^0.5 = 1.65
    r = math.exp(0.5)
    tol = {"rel": 1e-3, "abs": 1e-4}
    assert (
        results[1.2]["tis_truncated_frac"] == pytest.approx(odd) and results[10.0]["tis_truncated_frac"] == 0
    )
    assert results[10.0]["tis_weight_mean"] == pytest.approx(odd * r + (1 - odd), **tol)
    assert results[1.2]["tis_weight_mean"] == pytest.approx(odd * 1.2 + (1 - odd), **tol)
    assert results[1.2]["mismatch_kl_k1"] == pytest.approx(-0.5 * odd, **tol)
    assert results[1.2]["mismatch_kl_k3"] == pytest.approx(odd * (r - 1 - 0.5), **tol)
    assert results[1.2]["mismatch_ratio_p50"] == pytest.approx(1.0, abs=1e-4)
    assert results[1.2]["mismatch_ratio_p95"] == pytest.approx(r, rel=1e-3)
    # truncation changes the update: the published weights differ
    stores = [PolicyStore(tmp_path / str(c)).latest() for c in (10.0, 1.2)]
    a, b = (load_file(str(Path(v.path) / "model.safetensors")) for v in stores if v is not None)
    assert any(not torch.equal(a[k], b[k]) for k in a)


def test_tis_is_off_by_default():
    assert LossSpec().tis == "off" and LossSpec().tis_cap == 2.0


def test_the_demo_flag_turns_tis_on_in_the_run_request():
    from launch.demo import parse_args, run_request

    loss = LossSpec.model_validate(run_request(parse_args(["--tis", "sequence", "--tis-cap", "3"]))["loss"])
    assert (loss.tis, loss.tis_cap) == ("sequence", 3.0)
    assert LossSpec.model_validate(run_request(parse_args([]))["loss"]).tis == "off"
