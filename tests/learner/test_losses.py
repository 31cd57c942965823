"""Losses against hand-computed values; HRPO effective weights (AdaSR appendix B eq. 17) and the
gradient check (fused eq. 10 == sum of the three eq. 5 terms)."""

from __future__ import annotations

import math

import pytest
import torch

from learner.losses import aggregate, clipped_surrogate, hrpo_loss, k3_kl, policy_loss
from tests.learner.reference_losses import hrpo_terms

approx = pytest.approx


def test_clipped_surrogate_with_separate_low_and_high_clip():
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    c, clipped = clipped_surrogate(torch.log(ratio), torch.zeros(5), adv, eps_low=0.2, eps_high=0.28)
    # A>0,r=1.5 -> 1.28 (clipped high); A<0,r=.5 -> -.8 (clipped low); A<0,r=1.5 -> -1.5 (no clip);
    # A>0,r=.5 -> .5 (no clip); inside the range -> r A
    assert c.tolist() == approx([1.28, -0.8, -1.5, 0.5, 1.1], abs=1e-6)
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_aggregation_modes():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(values, mask, "token_mean").item() == approx(10 / 4)
    assert aggregate(values, mask, "seq_mean_token_mean").item() == approx((2 + 4) / 2)
    assert aggregate(values, mask, "seq_mean_token_sum").item() == approx((6 + 4) / 2)
    w = torch.tensor([0.5, 1.0])
    assert aggregate(values, mask, "seq_mean_token_sum", seq_weight=w).item() == approx((3 + 4) / 2)


def test_k3_kl_value_and_zero_at_equality():
    logp, ref = torch.log(torch.tensor([0.5, 0.3])), torch.log(torch.tensor([0.25, 0.3]))
    kl = k3_kl(logp, ref)
    assert kl[0].item() == approx(0.5 - math.log(0.5) - 1)
    assert kl[1].item() == approx(0.0, abs=1e-7)


def test_policy_loss_token_mean_with_kl_and_entropy():
    logp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is an observation: never counted
    ref = torch.log(torch.full((1, 3), 0.5))
    ent = torch.tensor([[1.0, 3.0, 100.0]])
    parts = policy_loss(logp, logp, adv, mask, ref_logp=ref, kl_coef=0.1, entropy=ent, entropy_coef=0.01)
    kl = 0.5 - math.log(0.5) - 1
    expected = -((1 - 2) / 2 - 0.1 * kl + 0.01 * (1 + 3) / 2)
    assert parts.loss.item() == approx(expected, rel=1e-6)
    assert parts.kl.item() == approx(kl, rel=1e-6)


def test_observation_tokens_never_change_any_loss():
    logp = torch.randn(2, 6)
    old = logp + 0.1 * torch.randn(2, 6)
    mask = torch.ones(2, 6)
    mask[:, 2] = 0.0
    stream = torch.zeros(2, 6)
    stream[:, :3] = 1
    adv = torch.randn(2, 6)
    adv2 = adv.clone()
    adv2[:, 2] = 1e6  # huge signal on the observation token
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        a = policy_loss(logp, old, adv, mask, aggregation=mode).loss
        b = policy_loss(logp, old, adv2, mask, aggregation=mode).loss
        assert a.item() == approx(b.item())
    h1 = hrpo_loss(logp, old, adv, adv, adv, mask, stream).loss
    h2 = hrpo_loss(logp, old, adv2, adv2, adv2, mask, stream).loss
    assert h1.item() == approx(h2.item())


def test_a_masked_token_with_an_absurd_behaviour_logprob_leaves_loss_and_gradient_finite():
    # exp(logp - old) overflows float32 at -200; inf * 0 in the mask (or in minimum's backward) was NaN
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, -200.0]])
    adv = torch.tensor([[0.5, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum"):
        logp.grad = None
        parts = policy_loss(logp, old, adv, mask, aggregation=mode)
        parts.loss.backward()
        assert math.isfinite(parts.loss.item()) and torch.isfinite(logp.grad).all()
        assert logp.grad[0, 2].item() == 0.0
    parts = policy_loss(logp, old, adv, mask)
    assert parts.loss.item() == approx(-0.5)
    h = hrpo_loss(logp, old, adv, adv, adv, mask, torch.zeros(1, 3))
    logp.grad = None
    h.loss.backward()
    assert math.isfinite(h.loss.item()) and torch.isfinite(logp.grad).all()


def test_hrpo_value_hand_computed():
    # one trajectory: 2 streaming, 1 observation, 3 deep tokens; ratio 1 -> C = A
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    stream = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    a_s, a_d, a_g = 2.0, -3.0, 0.5
    full = lambda v: torch.full((1, 6), v)  # noqa: E731
    zero = torch.zeros(1, 6)
    lam = 0.05
    loss = hrpo_loss(zero, zero, full(a_s), full(a_d), full(a_g), mask, stream, lam=lam).loss
    # lam/2 * 2 a_s + lam/3 * 3 a_d + 1/5 * 5 a_g
    assert loss.item() == approx(-(lam * a_s + lam * a_d + a_g))


def test_hrpo_effective_per_token_weights_eq17():
    """At theta = theta_old the gradient on log pi of each token is eq. 17 (divided by the B trajectories)."""
    lam = 0.05
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    stream = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    a_s = torch.tensor([[1.5] * 7, [0.0] * 7])
    a_d = torch.tensor([[-0.7] * 7, [2.0] * 7])
    a_g = torch.tensor([[0.3] * 7, [-1.0] * 7])
    logp = torch.zeros(2, 7, requires_grad=True)
    hrpo_loss(logp, logp.detach(), a_s, a_d, a_g, mask, stream, lam=lam).loss.backward()
    g = -logp.grad * 2  # objective gradient x B
    # row 0: |t_s| = 3 (observation excluded), |o| = 6, deep = 3
    ws = lam / 3 * 1.5 + 0.3 / 6
    wd = lam / 3 * -0.7 + 0.3 / 6
    assert g[0].tolist() == approx([ws, ws, 0.0, ws, wd, wd, wd], abs=1e-7)
    # row 1: empty streaming phase -> contributes nothing; deep = all 4 tokens
    wd1 = lam / 4 * 2.0 + -1.0 / 4
    assert g[1].tolist() == approx([wd1] * 4 + [0.0] * 3, abs=1e-7)
    assert torch.isfinite(logp.grad).all()


def test_hrpo_empty_phases_contribute_nothing():
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # second trajectory has nothing trained
    stream = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # first has no deep phase
    z = torch.zeros(2, 3)
    loss = hrpo_loss(z, z, torch.ones(2, 3), torch.full((2, 3), 7.0), torch.ones(2, 3), mask, stream, lam=0.1)
    # row 0: stream term .1 * 1, deep term 0 (empty), global 1; row 1: 0; mean over 2 rows
    assert loss.loss.item() == approx(-(0.1 + 1.0) / 2)
    assert math.isfinite(loss.loss.item())


def test_hrpo_gradient_equals_sum_of_its_three_terms():
    torch.manual_seed(0)
    b, t = 3, 9
    base = torch.randn(b, t)
    old = base + 0.4 * torch.randn(b, t)  # ratios far from 1: clipping active on some tokens
    mask = (torch.rand(b, t) > 0.2).float()
    stream = torch.zeros(b, t)
    stream[0, :4] = 1
    stream[1, :6] = 1  # row 2: empty streaming phase
    a_s, a_d, a_g = torch.randn(b, t), torch.randn(b, t), torch.randn(b, t)
    kw = {"lam": 0.3, "eps_low": 0.2, "eps_high": 0.28}

    x1 = base.clone().requires_grad_(True)
    fused = hrpo_loss(x1, old, a_s, a_d, a_g, mask, stream, **kw).loss
    fused.backward()

    grads = []
    values = []
    for k in range(3):
        xk = base.clone().requires_grad_(True)
        term = hrpo_terms(xk, old, a_s, a_d, a_g, mask, stream, **kw)[k]
        term.backward()
        grads.append(xk.grad.clone())
        values.append(term.item())
    ratio = torch.exp(base - old)
    assert ((ratio > 1.28) | (ratio < 0.8)).any()  # the check covers clipped tokens
    assert fused.item() == approx(sum(values), rel=1e-5)
    assert torch.allclose(x1.grad, grads[0] + grads[1] + grads[2], atol=1e-7)
    assert x1.grad.abs().sum() > 0
