"""The reward components' contract: one params model per component (each default written once), the
component names, and the spec check the reward service and the gateway both run.

``reward_svc.registry`` maps the same names to the component functions (docs/algorithms.md §1.6,
composition); the gateway checks a submission's ``RewardSpec`` with ``check_spec`` alone, without
importing the reward service. Imports only loom, pydantic and the standard library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from loom.contracts.reward_settings import get_reward_settings
from loom.contracts.wire import RewardSpec, SegmentKind, TaskKind
from loom.formats import REFLECTION_KEYWORDS

ANSWER_TAIL_CHARS = 300  # docs/algorithms.md §1.1: fall back to the last ~300 characters
MAX_ANSWER_CHARS = 2000  # the math verifier refuses a longer answer region (reward_svc.mathverify)
JUDGE_TEMPLATES = ("default", "arith")  # the judge's built-in templates (their text: reward_svc/judge.py)
# "arith": the compact template the built-in judge model is trained on (zoo/search/judge.py, docs/models.md)
ARITH_JUDGE_TEMPLATE = (
    "Question:\n{question}\n\nReference answer:\n{reference}\n\n{answer}\n\n"
    "Is the answer correct? Reply yes or no.\nVerdict:"
)
PROCESS_TEMPLATES = ("steps",)  # the PRM's built-in templates (their text: reward_svc/process.py)
DEFAULT_DQ = 1 / 225.09  # REA-RL's fixed D_q (the authors' code), docs/algorithms.md §1.5


class Params(BaseModel):
    """Base of every component's parameters: unknown keys are an error (422 with the path)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class NoParams(Params):
    pass


# One model per component; no class docstrings below: they would show in GET /v1/rewards/components.


# ``accuracy`` (docs/algorithms.md §1.1).
class AccuracyParams(Params):
    task: TaskKind | None = None  # overrides the group's task; default math
    number_fallback: bool = True  # unboxed answers: the last number of the tail
    # a longer tail is refused by the math verifier anyway
    tail_chars: int = Field(default=ANSWER_TAIL_CHARS, ge=1, le=MAX_ANSWER_CHARS)


# ``length_refined`` (docs/algorithms.md §1.3, REA-RL eq. 4 or the authors' code variant).
class RefinedParams(Params):
    variant: Literal["paper", "authors"] = "paper"


# ``efficiency`` (docs/algorithms.md §1.4, AdaSR eq. 7).
class EfficiencyParams(Params):
    alpha: float = Field(default=0.5, gt=0.0, lt=1.0)
    tau: float | None = Field(default=None, gt=0.0, description="None = group mean total length")


# ``reflection`` (docs/algorithms.md §1.5, REA-RL eq. 3).
class ReflectionParams(Params):
    keywords: list[str] = Field(
        default_factory=lambda: list(REFLECTION_KEYWORDS), min_length=1, max_length=64
    )
    cluster_chars: int = Field(default=59, ge=0, le=10_000)
    d_q: Literal["fixed", "running"] = "fixed"
    fixed_value: float = Field(default=DEFAULT_DQ, gt=0.0)
    q: float = Field(default=0.2, gt=0.0, lt=1.0)
    min_seen: int = Field(
        default=32, ge=1, description="running estimate used only after this many densities"
    )
    stat_key: str = Field(default="default", max_length=64)


# ``code_pass`` / ``code_all`` (docs/sandbox.md "Code rewards"): the tests' limits per run.
class CodeParams(Params):
    timeout_s: float = Field(default=5.0, gt=0, le=60, description="CPU seconds per test (wall: twice)")
    memory_mb: int = Field(default=512, ge=16, le=8192)
    output_bytes: int = Field(default=1 << 20, ge=1024, le=16 << 20)


def builtin_or_with(template: str, builtins: tuple[str, ...], field: str) -> str:
    """``template`` if it names a built-in template or holds the ``{field}`` placeholder."""
    if template not in builtins and f"{{{field}}}" not in template:
        raise ValueError(f"a built-in template ({', '.join(builtins)}) or one with {{{field}}}")
    return template


# ``judge`` (docs/interop-reward.md "Judge rewards"): a model-based reward from an operator's judge.
class JudgeParams(Params):
    judge: str = Field(
        default="default", min_length=1, max_length=64, description="a name in LOOM_REWARD_JUDGES"
    )
    template: str = Field(
        default="default",
        min_length=1,
        max_length=8000,
        description="a built-in template's name, or a template with {question} {answer} {reference}",
    )
    mode: Literal["verdict", "logprob"] = "verdict"
    timeout_s: float = Field(default=30.0, gt=0, le=300, description="per judge request")
    max_tokens: int = Field(default=8, ge=1, le=512)
    max_answer_chars: int = Field(
        default=8000,
        ge=64,
        le=200_000,
        description="the answer's last characters the judge reads (its final answer is at the end); "
        "a longer answer is cut at its start and says so",
    )

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        return builtin_or_with(v, JUDGE_TEMPLATES, "answer")


# ``process`` (docs/interop-reward.md "Process rewards"): a PRM's P(yes) per step prefix.
class ProcessParams(Params):
    prm: str = Field(
        default="default", min_length=1, max_length=64, description="a name in LOOM_REWARD_JUDGES"
    )
    steps: Literal["lines", "segments", "separator"] = "lines"
    separator: str | None = Field(
        default=None, min_length=1, max_length=64, description="steps='separator': the step separator"
    )
    segment_kinds: list[SegmentKind] | None = Field(
        default=None,
        max_length=16,
        description="steps='segments': the kinds read (None: all but observations)",
    )
    template: str = Field(
        default="steps",
        min_length=1,
        max_length=8000,
        description="a built-in template's name, or a template with {question} {steps}",
    )
    aggregate: Literal["min", "mean", "last", "product"] = "min"
    max_steps: int = Field(default=32, ge=1, le=256, description="more steps: the last ones merged into one")
    max_step_chars: int = Field(
        default=2000, ge=16, le=100_000, description="a step's last characters the PRM reads"
    )
    max_prefix_chars: int = Field(
        default=8000, ge=64, le=200_000, description="the prefix's last characters the PRM reads"
    )
    timeout_s: float = Field(default=30.0, gt=0, le=300, description="per PRM request")

    @field_validator("template")
    @classmethod
    def _template(cls, v: str) -> str:
        return builtin_or_with(v, PROCESS_TEMPLATES, "steps")

    @model_validator(mode="after")
    def _separator(self) -> ProcessParams:
        if self.steps == "separator" and self.separator is None:
            raise ValueError("steps='separator' needs a separator")
        return self


# The one table of components: name -> its params model (a component's registration is its line
# here; its function is found by name, reward_svc/registry.py).
COMPONENT_PARAMS: dict[str, type[Params]] = {
    "accuracy": AccuracyParams,
    "format_stream": NoParams,
    "format_deep": NoParams,
    "format_think": NoParams,
    "format_spawn": NoParams,
    "length_kimi": NoParams,
    "length_refined": RefinedParams,
    "length_stream": NoParams,
    "length_deep": NoParams,
    "efficiency": EfficiencyParams,
    "reflection": ReflectionParams,
    "code_pass": CodeParams,
    "code_all": CodeParams,
    "judge": JudgeParams,
    "process": ProcessParams,
}


class RequestError(ValueError):
    """Bad input found after schema validation: ``status`` 422 (field path in ``loc``) or 413."""

    def __init__(self, status: int, loc: list[str | int], msg: str) -> None:
        super().__init__(msg)
        self.status = status
        self.loc = loc
        self.msg = msg

    def body(self) -> dict[str, Any]:
        error = "payload_too_large" if self.status == 413 else "validation_error"
        return {"error": error, "detail": [{"loc": self.loc, "msg": self.msg, "type": error}]}


def check_timeout(timeout_s: int, loc: Sequence[str | int], max_timeout_s: int | None = None) -> None:
    """A per-item deadline above the operator's bound (``LOOM_REWARD_MAX_TIMEOUT_S``) is a 422: every
    item may cost its deadline in a verifier process. ``max_timeout_s`` None: the reward settings'."""
    if max_timeout_s is None:
        max_timeout_s = get_reward_settings().max_timeout_s
    if timeout_s > max_timeout_s:
        raise RequestError(
            422, [*loc], f"at most {max_timeout_s} s on this deployment (LOOM_REWARD_MAX_TIMEOUT_S)"
        )


def check_spec(
    spec: RewardSpec, loc: Sequence[str | int] = ("body", "spec"), max_timeout_s: int | None = None
) -> None:
    """Components known, weights finite, parameters valid, each component once, the deadline within
    the operator's bound: a ``RequestError`` (422) naming the field otherwise."""
    check_timeout(spec.timeout_s, [*loc, "timeout_s"], max_timeout_s)
    for i, comp in enumerate(spec.components):
        where = [*loc, "components", i]
        if comp.name not in COMPONENT_PARAMS:
            raise RequestError(
                422, [*where, "name"], f"unknown component {comp.name!r}; known: {sorted(COMPONENT_PARAMS)}"
            )
        if not math.isfinite(comp.weight):
            raise RequestError(422, [*where, "weight"], "weight must be finite")
        try:
            COMPONENT_PARAMS[comp.name].model_validate(comp.params)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise RequestError(422, [*where, "params", *err["loc"]], err["msg"]) from None
    names = [c.name for c in spec.components]
    if len(set(names)) != len(names):
        raise RequestError(422, [*loc, "components"], "each component may appear once")
