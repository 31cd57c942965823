"""The contract side of the three scratch features: what a new feature adds to
``loom/contracts/{estimators,modes,rewards}.py``, its params model (here, in its own file) and its
one table line (:func:`register`, which must run before ``loom.contracts.wire`` is imported, as a
line written in the table is: the wire's ``Mode`` and ``Estimator`` derive from the tables)."""

from __future__ import annotations

import sys

from pydantic import BaseModel, ConfigDict, Field

from loom.contracts.estimators import ESTIMATOR_PARAMS, EstimatorParams
from loom.contracts.modes import MODE_PARAMS, ModeParams


class ScratchParams(EstimatorParams):
    scale: float = 1.0
    baseline: float = -1.0  # A_i = scale (R_i - baseline): REINFORCE with a fixed baseline


class ScratchModeParams(ModeParams):
    rounds: int = Field(2, ge=1, le=4)


class ScratchRewardParams(BaseModel):
    # loom.contracts.rewards.Params' config (that module imports the wire, so not imported here)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    bonus: float = 0.5


def register() -> None:
    """The three table lines."""
    assert "loom.contracts.wire" not in sys.modules, "a table line is read when the wire is built"
    ESTIMATOR_PARAMS["scratch"] = ScratchParams
    MODE_PARAMS["scratch"] = ScratchModeParams
    from loom.contracts.rewards import COMPONENT_PARAMS

    COMPONENT_PARAMS["scratch"] = ScratchRewardParams  # type: ignore[assignment]
