"""Log-prob recomputation on the engine's exact token ids, both layouts, micro-batched."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner import logprobs as lp
from learner.losses import hrpo_loss
from loom.contracts.wire import Segment, Trajectory
from tests.learner.reference_losses import hrpo_terms


def _reference(model, ids, start, groups=None):
    """Single-sequence forward, no padding; group layout mask built token pair by token pair."""
    x = torch.tensor([ids])
    kwargs = {}
    if groups is not None:
        pos, seen = [], {}
        for g in groups:
            pos.append(seen.get(g, 0))
            seen[g] = pos[-1] + 1
        n = len(ids)
        allowed = torch.zeros(1, 1, n, n, dtype=torch.bool)
        for i in range(n):
            for j in range(i + 1):
                allowed[0, 0, i, j] = groups[j] <= groups[i]
        kwargs = {"position_ids": torch.tensor([pos]), "attention_mask": allowed}
    logits = model(x, **kwargs).logits[0].float()
    logp = torch.log_softmax(logits[start - 1 : len(ids) - 1], dim=-1)
    return logp.gather(1, x[0, start:, None]).squeeze(1)


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def _trajs(n=5, seed=0, group_layout=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 6, (1,), generator=g))
        c = int(torch.randint(3, 15, (1,), generator=g))
        ids = torch.randint(0, 64, (p + c,), generator=g).tolist()
        segs = [Segment(kind="stream", start=0, end=1), Segment(kind="observation", start=1, end=3)]
        meta = {"layout": "group_positions"} if group_layout else {}
        out.append(
            Trajectory(
                id=f"t{i}", group_id="q", prompt_ids=ids[:p], completion_ids=ids[p:], segments=segs, meta=meta
            )
        )
    return out


def test_micro_batches_respect_the_token_budget():
    lengths = [10, 3, 7, 7, 2, 9, 30]
    batches = lp.micro_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 20
    assert [6] in batches  # an over-long row goes alone


@pytest.mark.parametrize("group_layout", [False, True])
def test_recompute_matches_single_sequence_forward(model, group_layout):
    trajs = _trajs(group_layout=group_layout)
    with torch.no_grad():
        outs = lp.recompute(model, trajs, token_budget=40)
    assert len(outs) > 1  # really micro-batched
    seen = 0
    for mb in outs:
        for row, i in enumerate(mb.index):
            t = trajs[i]
            ids = t.prompt_ids + t.completion_ids
            groups = lp.layout_of(t).groups
            ref = _reference(model, ids, len(t.prompt_ids), groups)
            n = len(t.completion_ids)
            assert torch.allclose(mb.logp[row, :n], ref, atol=1e-5)
            assert mb.valid[row, :n].sum() == n and mb.valid[row, n:].sum() == 0
            seen += 1
    assert seen == len(trajs)


def test_group_layout_differs_from_interleaved_and_hides_targets_from_sources(model):
    t = _trajs(n=1, seed=3, group_layout=True)[0]
    layout = lp.layout_of(t)
    p = len(t.prompt_ids)
    assert layout.groups == [0] * p + [1, 0, 0] + [1] * (len(t.completion_ids) - 3)
    # target positions count from 0, source positions continue after the prompt
    assert lp.group_positions(layout.groups)[: p + 4] == list(range(p)) + [0, p, p + 1, 1]
    plain = t.model_copy(update={"meta": {}})
    with torch.no_grad():
        a = lp.recompute(model, [t])[0].logp
        b = lp.recompute(model, [plain])[0].logp
    assert not torch.allclose(a, b, atol=1e-4)


def test_explicit_groups_from_meta(model):
    t = _trajs(n=1, seed=4)[0]
    n = len(t.prompt_ids) + len(t.completion_ids)
    t2 = t.model_copy(update={"meta": {"layout": "group_positions", "groups": [0] * n}})
    with torch.no_grad():
        a = lp.recompute(model, [t])[0].logp
        b = lp.recompute(model, [t2])[0].logp
    assert torch.allclose(a, b, atol=1e-5)  # one group everywhere == plain causal layout
    # the streaming mode's record: completion groups only, the prompt is source
    derived = _trajs(n=1, seed=4, group_layout=True)[0]
    comp = lp.layout_of(derived).groups[len(t.prompt_ids) :]
    t3 = t.model_copy(update={"meta": {"layout": "group_positions", "completion_groups": comp}})
    assert lp.layout_of(t3).groups == lp.layout_of(derived).groups
    bad = t.model_copy(update={"meta": {"layout": "group_positions", "groups": [0]}})
    with pytest.raises(ValueError, match="groups"):
        lp.layout_of(bad)


def test_mismatch_metric():
    rec = torch.tensor([[-1.0, -2.0, -3.0]])
    beh = rec + torch.tensor([[0.1, -0.3, 5.0]])
    m = lp.mismatch(beh, rec, torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["logprob_mismatch_mean"] == pytest.approx(0.2)
    assert m["logprob_mismatch_max"] == pytest.approx(0.3)
    assert m["logprob_mismatch_k3"] > 0


def test_hrpo_parameter_gradient_equals_sum_of_terms_on_a_real_model(model_dir):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    trajs = _trajs(n=3, seed=5)
    params = [p for p in model.parameters()]

    def logp_batch():
        (mb,) = lp.recompute(model, trajs, token_budget=10_000)
        order = sorted(range(len(mb.index)), key=lambda r: mb.index[r])
        return mb.logp[order], mb.valid[order]

    torch.manual_seed(1)
    with torch.no_grad():
        base, valid = logp_batch()
    old = base + 0.3 * torch.randn_like(base)
    stream = torch.zeros_like(valid)
    stream[:, :1] = 1
    a = [torch.randn_like(base) for _ in range(3)]
    model.zero_grad()
    logp, _ = logp_batch()
    hrpo_loss(logp, old, a[0], a[1], a[2], valid, stream, lam=0.5).loss.backward()
    fused = [p.grad.clone() for p in params]
    summed = [torch.zeros_like(p) for p in params]
    for k in range(3):
        model.zero_grad()
        logp, _ = logp_batch()
        hrpo_terms(logp, old, a[0], a[1], a[2], valid, stream, lam=0.5)[k].backward()
        for s, p in zip(summed, params, strict=True):
            s += p.grad
    assert sum(float(f.abs().sum()) for f in fused) > 0
    for f, s in zip(fused, summed, strict=True):
        assert torch.allclose(f, s, atol=1e-6)
