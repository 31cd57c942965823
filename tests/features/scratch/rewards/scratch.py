"""A scratch reward component, the whole of it (tests/features/test_one_registration.py registers
it): ``+bonus`` for a correct answer, ``-bonus`` otherwise; it reads the accuracy verdicts, so a spec
that names it alone still has them computed."""

from __future__ import annotations

from typing import Any

from reward_svc.context import GroupContext, reads
from tests.features.scratch.contracts import ScratchRewardParams


@reads("accuracy")
def scratch(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    p = ScratchRewardParams.model_validate(params)
    return [p.bonus * (2 * c - 1) for c in ctx.accuracy()]
