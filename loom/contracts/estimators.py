"""The ``estimator_params`` contract: one typed params model per advantage estimator, each default
written once (docs/algorithms.md §5), and the one table of estimators, ``ESTIMATOR_PARAMS``.

On the wire a ``TrainBatch`` (and a run's request) carries ``estimator_params`` as a JSON object,
as ever; a model parses it into a pydantic discriminated union of the table's models keyed by the
estimator's name (:func:`params_union`, its tag taken from the model's ``estimator`` field by
:func:`tagged_params`, and never written out), so a hop receives the typed params, parsed where the
model entered its process. A key the estimator does not read is refused by name first
(:func:`check_estimator_params`: a misspelt parameter cannot silently fall back to its default).

Imports only pydantic and the standard library (``loom.contracts.wire`` imports this module).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model

EPS = 1e-6  # the eps of N_G(x) = (x - mean) / (std + eps)
TREERL_REWARD_KEY = "accuracy"  # TreeRL's leaf value: the correctness component


class EstimatorParams(BaseModel):
    """What every estimator reads: the normalisation eps, the reward it ranks by, and the inputs of
    the adaptive batch size (AttnRL eq. 10, reported as the learner's ``next_batch_size`` metric)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    eps: float = EPS
    reward_key: str | None = Field(default=None, description="a reward component; None or 'total': the total")
    batch_size: int | None = Field(default=None, description="B_m, prompts sampled this step")
    target_groups: int | None = Field(default=None, description="B', wanted groups with signal")
    batch_lambda: float = 0.9


class GrpoParams(EstimatorParams):
    """GRPO (docs/algorithms.md §5.1)."""


class DrGrpoParams(EstimatorParams):
    """Dr. GRPO (docs/algorithms.md §5.1); ``eps`` is not used (no std division)."""


class ReaParams(EstimatorParams):
    """REA-RL (docs/algorithms.md §5.1)."""


class AprParams(EstimatorParams):
    """APR (docs/algorithms.md §5.1)."""


class GlobalBaselineParams(EstimatorParams):
    """Reinforce-Ada's global baseline (docs/algorithms.md §4); ``std`` also divides by the pool's std."""

    std: bool = False


PROCESS_KEY = "process"  # the reward component whose step scores the step-level estimators read


class TreerlParams(EstimatorParams):
    """TreeRL (docs/algorithms.md §5.1); ``reward_key`` None: the leaf value is the correctness;
    ``process_weight`` w > 0 mixes each node's PRM score into its value (docs/algorithms.md §5.4)."""

    process_weight: float = Field(default=0.0, ge=0.0, le=1.0)
    process_key: str = PROCESS_KEY


class StepGrpoParams(EstimatorParams):
    """Step-level GRPO (docs/algorithms.md §5.4): the outcome advantage plus ``process_coef`` times the
    step score normalised over the group's steps at the same depth."""

    process_coef: float = Field(default=1.0, ge=0.0, le=100.0)
    process_key: str = PROCESS_KEY


class HrpoNames(BaseModel):
    """Reward component names HRPO reads (reward_svc's names by default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accuracy: str = "accuracy"
    format_stream: str = "format_stream"
    format_deep: str = "format_deep"
    length_stream: str = "length_stream"
    length_deep: str = "length_deep"
    efficiency: str = "efficiency"


class HrpoParams(EstimatorParams):
    """HRPO (AdaSR eq. 8; docs/algorithms.md §5.1): ``w_acc``/``w_fmt`` are AdaSR Table 6's
    coefficients, ``beta`` the length/efficiency weight applied after normalisation (appendix C)."""

    names: HrpoNames = Field(default_factory=HrpoNames)
    beta: float = 0.05
    w_acc: float = 1.0
    w_fmt: float = 2.0
    mask_length_by_format: bool = True


ESTIMATOR_PARAMS: dict[str, type[EstimatorParams]] = {
    "grpo": GrpoParams,
    "dr_grpo": DrGrpoParams,
    "global_baseline": GlobalBaselineParams,
    "hrpo": HrpoParams,
    "treerl": TreerlParams,
    "rea": ReaParams,
    "apr": AprParams,
    "step_grpo": StepGrpoParams,
}


def check_estimator_params(estimator: str, params: Mapping[str, Any]) -> None:
    """ValueError naming the keys ``estimator`` does not read (the values are checked when read)."""
    known = set(ESTIMATOR_PARAMS.get(estimator, EstimatorParams).model_fields)
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"estimator_params {unknown} are not read by estimator {estimator!r}; it reads {sorted(known)}"
        )


def estimator_params(estimator: str, params: Mapping[str, Any]) -> EstimatorParams:
    """The typed params of ``estimator``: unknown keys and wrong types are a ``ValueError``
    (pydantic's ``ValidationError``)."""
    check_estimator_params(estimator, params)
    return ESTIMATOR_PARAMS[estimator].model_validate(dict(params))


TAG = "estimator"  # the union's discriminator: the estimator's name, from the model that holds the params


def params_union() -> Any:
    """The table's params models as one discriminated union keyed by ``TAG`` (each model a subclass
    of the table's, with its name as a literal tag that is excluded when written out). Built when the
    wire models are, so a table line is enough for a new estimator."""
    members = [
        create_model(
            model.__name__,
            __base__=model,
            __module__=model.__module__,
            **{TAG: (Literal[name], Field(name, exclude=True, repr=False))},  # type: ignore[call-overload]
        )
        for name, model in ESTIMATOR_PARAMS.items()
    ]
    return Annotated[Union[tuple(members)], Field(discriminator=TAG)]  # noqa: UP007 (a runtime tuple)


def tagged_params(params: Any, info: ValidationInfo) -> Any:
    """A ``field_validator(mode="before")`` of ``estimator_params``: the given params (a dict, None or a
    params model) tagged with the model's ``estimator`` (validated before them), unknown keys refused
    by name (``ValueError``)."""
    name = info.data.get("estimator", "grpo")
    if isinstance(params, EstimatorParams):
        if getattr(params, TAG, None) == name:
            return params  # parsed already (the gateway's, handed to the batch it builds)
        params = params.model_dump(exclude={TAG})
    if params is None:
        params = {}
    if isinstance(params, Mapping):
        given = {k: v for k, v in params.items() if k != TAG}
        if params.get(TAG, name) != name:  # the schema shows the tag: when given, it is the estimator
            raise ValueError(f"estimator_params.{TAG} must be the estimator, {name!r}")
        check_estimator_params(name, given)
        return {**given, TAG: name}
    return params
