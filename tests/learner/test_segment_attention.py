"""Attention per trajectory inside packed rows (learner/segment_attention.py) equals sdpa under the row's
block-diagonal mask, values and gradients, and the learner switches only sdpa models to it."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import AutoModelForCausalLM

from learner import logprobs as lp
from learner import segment_attention as sa
from loom.layout import group_visibility


class _Attn(torch.nn.Module):
    num_key_value_groups = 2


def _rows() -> list[list[tuple[int, list[int] | None]]]:
    """Two rows of (length, groups): None = interleaved causal, else a group-position trajectory."""
    return [
        [(5, None), (7, [0, 0, 0, 1, 1, 0, 1]), (3, None)],  # 15 of 16: one padding token
        [(9, [0, 0, 1, 1, 1, 0, 0, 1, 1]), (1, None), (4, None)],  # 14 of 16
    ]


def _inputs(width: int = 16, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, width, dim, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, width, dim, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, width, dim, generator=g, requires_grad=True)
    mask = torch.zeros(2, 1, width, width, dtype=torch.bool)
    bounds, real = [], torch.zeros(2, width, dtype=torch.bool)
    for r, row in enumerate(_rows()):
        o = 0
        for n, groups in row:
            mask[r, 0, o : o + n, o : o + n] = group_visibility(groups or [0] * n)
            bounds.append((r, o, o + n, groups is None))
            real[r, o : o + n] = True
            o += n
        mask[r, 0, o:, o:] = torch.eye(width - o, dtype=torch.bool)  # padding sees itself
    return q, k, v, mask, sa.segments(bounds), real


def test_per_trajectory_attention_equals_the_block_masked_row_with_gradients():
    q, k, v, mask, segs, real = _inputs()
    scale = 8**-0.5
    got, weights = sa.segment_attention_forward(_Attn(), q, k, v, mask, scaling=scale, loom_segments=segs)
    assert weights is None and got.shape == (2, 16, 4, 8)  # [b, W, H, D], as transformers' sdpa returns
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=scale).transpose(1, 2)
    assert torch.allclose(got[real], want[real], atol=1e-6, rtol=0)
    assert float(got.detach()[~real].abs().sum()) == 0.0  # padding: zero, never read
    w = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)) * real[:, :, None, None]
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    grads_ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(grads, grads_ref, strict=True):
        assert float(b.abs().sum()) > 0
        assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_without_segments_it_is_sdpa_and_bad_segments_are_refused():
    q, k, v, mask, segs, _ = _inputs()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain, _ = sa.segment_attention_forward(_Attn(), q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(_Attn(), q, k, v, mask, scaling=0.3)
    assert torch.equal(plain, ref)
    gap = sa.segments([(0, 0, 5, True), (0, 6, 9, True)])
    with pytest.raises(ValueError, match="tile"):
        sa.segment_attention_forward(_Attn(), q, k, v, mask, loom_segments=gap)
    with pytest.raises(ValueError, match="in order"):
        sa.segment_attention_forward(_Attn(), q, k, v, mask, loom_segments=segs.flip(0))
    with pytest.raises(ValueError, match="4D attention mask"):
        sa.segment_attention_forward(_Attn(), q, k, v, None, loom_segments=segs)


def test_packed_recompute_switches_only_sdpa_models_and_both_equal_the_padded_path(model_dir, batch_parts):
    groups, _ = batch_parts(n_groups=2, seed=5)
    trajs = []
    for i, t in enumerate(x for g in groups for x in g.trajectories):
        if i % 2:  # mixed lengths, so that trajectories share rows
            n = 2 + i // 2
            t = t.model_copy(
                update={
                    "completion_ids": t.completion_ids[:n],
                    "logprobs": (t.logprobs or [])[:n] or None,
                    "loss_mask": t.loss_mask[:n],
                    "segments": [],
                }
            )
        trajs.append(t.model_copy(update={"meta": {"layout": lp.GROUP_LAYOUT}}) if i % 3 == 0 else t)
    results = {}
    interleaved = [t.model_copy(update={"meta": {}}) for t in trajs]
    for impl in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation=impl)
        # eager adds a 4D mask to the scores: it takes no boolean group-visibility mask
        trajs = trajs if impl == "sdpa" else interleaved
        padded = lp.recompute(model, trajs, token_budget=10_000)
        assert model.config._attn_implementation == impl  # the padded path switches nothing
        switched = False
        for per_trajectory in (False, True, False):
            packed = lp.recompute(
                model, trajs, token_budget=10_000, packing=True, chunk=8, segment_attention=per_trajectory
            )
            switched = switched or (impl == "sdpa" and per_trajectory)  # once, then it stays
            assert (model.config._attn_implementation == sa.ATTENTION) == switched
            assert len(packed) == len(padded) == 1 and packed[0].rows is not None
            assert len(packed[0].rows) < len(trajs)  # several trajectories share a row
            for r, i in enumerate(packed[0].index):
                n = len(trajs[i].completion_ids)
                want = padded[0].logp[padded[0].index.index(i), :n]
                assert torch.allclose(packed[0].logp[r, :n], want, atol=1e-5, rtol=0)
            results[impl, per_trajectory, switched] = packed[0].logp
    # once switched, the model still runs plain sdpa with the row's mask where segments are not passed
    assert torch.allclose(results["sdpa", False, True], results["sdpa", False, False], atol=1e-6, rtol=0)
