"""Length rewards (docs/algorithms.md §1.3).

- ``length_kimi``: Kimi K1.5 length reward, REA-RL eq. 1 (group-relative);
- ``length_refined``: REA-RL eq. 4, or the authors' code variant (``variant="authors"``);
- ``length_stream`` / ``length_deep``: AdaSR eq. 6 phase penalties, NOT gated by accuracy or
  format (AdaSR appendix C: a gated penalty rewards failing the gate).

Lengths are completion tokens (approximate tokens for text-only trajectories).
"""

from __future__ import annotations

import math
from typing import Any

from loom.contracts.rewards import NoParams, RefinedParams
from reward_svc.context import GroupContext, reads


def kimi_lambda(lengths: list[int]) -> list[float]:
    """λ_i = 1 − (len_i − min_len)/(max_len − min_len); all lengths equal → 0 (REA-RL eq. 1)."""
    lo, hi = min(lengths, default=0), max(lengths, default=0)
    if hi == lo:
        return [0.0] * len(lengths)
    return [1.0 - (n - lo) / (hi - lo) for n in lengths]


@reads("accuracy")
def length_kimi(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """REA-RL eq. 1: R = λ if correct else min(0.5, λ)."""
    NoParams.model_validate(params)
    lam = kimi_lambda([v.n_tokens for v in ctx.views])
    return [x if c else min(0.5, x) for x, c in zip(lam, ctx.accuracy(), strict=True)]


@reads("accuracy")
def length_refined(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """REA-RL eq. 4: R = λ if correct else 0.

    ``variant="authors"`` (the authors' code): min/max over the correct samples only and
    λ = 0.5 − (len − min_c)/(max_c − min_c); 0 when the correct samples all have one length.
    """
    p = RefinedParams.model_validate(params)
    correct = ctx.accuracy()
    lengths = [v.n_tokens for v in ctx.views]
    if p.variant == "paper":
        lam = kimi_lambda(lengths)
        return [x if c else 0.0 for x, c in zip(lam, correct, strict=True)]
    ok = [n for n, c in zip(lengths, correct, strict=True) if c]
    if not ok or max(ok) == min(ok):
        return [0.0] * len(lengths)
    lo, hi = min(ok), max(ok)
    return [0.5 - (n - lo) / (hi - lo) if c else 0.0 for n, c in zip(lengths, correct, strict=True)]


def length_stream(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """AdaSR eq. 6: R^{Ls} = (1/N) Σ_n −log(1 + |s_n|) over the N streaming segments (0 if N = 0)."""
    NoParams.model_validate(params)
    out = []
    for v in ctx.views:
        n = len(v.stream)
        out.append(sum(-math.log1p(p.n_tokens) for p in v.stream) / n if n else 0.0)
    return out


def length_deep(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    """AdaSR eq. 6: R^{Ld} = −log(1 + L^D)."""
    NoParams.model_validate(params)
    return [-math.log1p(v.deep_tokens) for v in ctx.views]
