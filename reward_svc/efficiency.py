"""Efficiency reward, AdaSR eq. 7 (docs/algorithms.md §1.4):

R_eff = acc · fmt_s · fmt_d · (1 − exp(−L^D/τ)) · (1 − exp(−L^S/τ)) · exp(−(α L^S + L^D)/τ)

with 0 < α < 1 (default 0.5) and τ > 0 (default: the group's mean total completion length).
"""

from __future__ import annotations

import math
from typing import Any

from loom.contracts.rewards import EfficiencyParams
from reward_svc.context import GroupContext, reads
from reward_svc.format import deep_ok, stream_ok


def r_eff(acc: float, fmt_s: float, fmt_d: float, l_s: float, l_d: float, alpha: float, tau: float) -> float:
    """AdaSR eq. 7 for one trajectory."""
    gate = acc * fmt_s * fmt_d
    if gate == 0.0:
        return 0.0
    lower = (1.0 - math.exp(-l_d / tau)) * (1.0 - math.exp(-l_s / tau))
    return gate * lower * math.exp(-(alpha * l_s + l_d) / tau)


@reads("accuracy")
def efficiency(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    p = EfficiencyParams.model_validate(params)
    tau = p.tau
    if tau is None:
        total = [v.n_tokens for v in ctx.views]
        tau = sum(total) / len(total) if total else 0.0
        if tau <= 0.0:
            return [0.0] * len(ctx.views)
    skip = ctx.markers.skip
    return [
        r_eff(a, float(stream_ok(v, skip)), float(deep_ok(v)), v.stream_tokens, v.deep_tokens, p.alpha, tau)
        for a, v in zip(ctx.accuracy(), ctx.views, strict=True)
    ]
