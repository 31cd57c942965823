"""The gateway's public request/response contracts (jobs and runs). Stage payloads are loom.contracts.wire."""

from __future__ import annotations

import importlib.util
import re
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from loom.batching import TOTAL as TOTAL_REWARD
from loom.contracts.estimators import tagged_params
from loom.contracts.jobs import Generation, JobStatus, JobView, ScoredGroup, TaskItem
from loom.contracts.policies import run_namespace
from loom.contracts.wire import (
    MAX_VERSION,
    Contract,
    Estimator,
    EstimatorParamsUnion,
    Lineage,
    LossSpec,
    PolicyAt,
    SamplingParams,
    TaskKind,
)

DATASET_ID = re.compile(r"ds-[0-9a-f]{24}")  # a stored dataset (gateway/datasets.py)
__all__ = ["MAX_VERSION", "JobStatus", "JobView", "ScoredGroup", "TaskItem"]  # the contracts', re-exported

RunStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class JobRequest(Generation, PolicyAt):
    job_key: str = Field(min_length=1, max_length=200, description="client idempotency key")
    prompts: list[Annotated[str, Field(min_length=1, max_length=100_000)]] | None = Field(
        default=None, max_length=4096
    )
    tasks: list[TaskItem] | None = Field(default=None, max_length=4096)

    @model_validator(mode="after")
    def _one_source(self) -> JobRequest:
        if (self.prompts is None) == (self.tasks is None):
            raise ValueError("give exactly one of prompts or tasks")
        if not (self.prompts or self.tasks):
            raise ValueError("no prompts")
        return self

    def items(self) -> list[TaskItem]:
        if self.tasks is not None:
            return list(self.tasks)
        return [TaskItem(prompt=p) for p in self.prompts or []]


def _span(lo: int, hi: int) -> Any:
    return Annotated[tuple[Annotated[int, Field(ge=lo, le=hi)], Annotated[int, Field(ge=lo, le=hi)]], ...]


class ArithKnobs(Contract):
    """zoo.tiny.tasks.arith_problem's settings: operand digit counts (min, max)."""

    ops: list[Literal["+", "-", "*"]] = Field(default=["+", "-", "*"], min_length=1, max_length=3)
    digits: _span(1, 9) = (2, 3)  # type: ignore[valid-type]
    mul_digits_b: _span(1, 9) = (1, 1)  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _ordered(self) -> ArithKnobs:
        for name in ("digits", "mul_digits_b"):
            lo, hi = getattr(self, name)
            if lo > hi:
                raise ValueError(f"{name} must be (min, max), got ({lo}, {hi})")
        return self


class CountdownKnobs(Contract):
    """zoo.tiny.tasks.countdown_problem's settings."""

    n_numbers: int = Field(default=3, ge=2, le=5)
    max_number: int = Field(default=9, ge=1, le=50)
    max_target: int = Field(default=99, ge=1, le=1_000_000)


class CodeKnobs(Contract):
    """zoo.code.tasks.code_problems's settings: the sources its problems are drawn from."""

    sources: list[Literal["list", "range", "string"]] = Field(
        default=["list", "range", "string"], min_length=1, max_length=3
    )


KNOBS: dict[str, type[Contract]] = {"arith": ArithKnobs, "countdown": CountdownKnobs, "code": CodeKnobs}


class DatasetSpec(Contract):
    """``builtin`` synthetic tasks (zoo.tiny.tasks; ``code``: zoo.code.tasks's programming problems), a
    stored dataset ``id`` (``POST /v1/datasets``), or inline ``jsonl`` text (small datasets; stored the
    same way at submission) of {prompt, answer}."""

    builtin: Literal["arith", "countdown", "code"] | None = None
    size: int = Field(default=256, ge=1, le=100_000)
    seed: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    knobs: dict[str, Any] = Field(
        default_factory=dict,
        description="generator settings of the built-in task (ArithKnobs / CountdownKnobs / CodeKnobs); "
        "empty: the "
        "distribution the tiny model was trained on",
    )
    jsonl: str | None = Field(default=None, description="uploaded JSONL text, one {prompt, answer} a line")
    id: str | None = Field(
        default=None, pattern=DATASET_ID.pattern, description="a dataset stored by POST /v1/datasets"
    )
    task: TaskKind | None = Field(default=None, description="task kind of uploaded items")

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if sum(x is not None for x in (self.builtin, self.jsonl, self.id)) != 1:
            raise ValueError("give exactly one of builtin, jsonl or id")
        if self.knobs:
            if self.builtin is None:
                raise ValueError("knobs apply to builtin datasets only")
            try:
                KNOBS[self.builtin].model_validate(self.knobs)
            except ValidationError as exc:
                where = "; ".join(
                    f"knobs.{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" if e["loc"] else e["msg"]
                    for e in exc.errors()
                )
                raise ValueError(where) from None
        return self


class Schedule(Contract):
    steps: int = Field(default=10, ge=1, le=1_000_000)
    batch_size: int = Field(default=8, ge=1, le=4096, description="prompts per step (B_0)")
    staleness: int = Field(default=1, ge=0, le=8, description="max policy versions behind; 0 = synchronous")
    adaptive_batch: bool = Field(default=False, description="AttnRL eq. 10")
    target_groups: int | None = Field(default=None, ge=1, description="B': wanted groups with signal")
    batch_lambda: float = Field(default=0.9, ge=0.0, le=1.0)
    min_batch: int = Field(default=1, ge=1, le=4096)
    max_batch: int = Field(default=256, ge=1, le=4096)
    seed: int = Field(default=0, ge=-(2**63), le=2**63 - 1)

    @model_validator(mode="after")
    def _bounds(self) -> Schedule:
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch {self.min_batch} > max_batch {self.max_batch}")
        return self


TrackerName = Literal["tensorboard", "wandb", "mlflow"]
# the import each tracker needs: its optional extra (pyproject.toml) installs it
TRACKER_LIBRARIES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def tracker_installed(name: str) -> bool:
    return importlib.util.find_spec(TRACKER_LIBRARIES[name]) is not None


class TrackerSpec(Contract):
    """One experiment tracker of a run (docs/trackers.md): where its metrics and samples go."""

    name: TrackerName
    project: str | None = Field(
        default=None,
        max_length=128,
        pattern=r"^[\w.\- ]+$",
        description="W&B project / MLflow experiment (default 'loom'); TensorBoard: unused",
    )
    dir: str | None = Field(
        default=None,
        max_length=500,
        description="where its files go: a relative folder under the run's folder "
        "(data_dir/runs/<id>/); default trackers/<name>",
    )
    tracking_uri: str | None = Field(
        default=None,
        max_length=2000,
        description="MLflow tracking URI: an operator setting (LOOM_TRACKERS) only, the gateway never "
        "contacts a server named in a request; default a file store under the run's folder",
    )
    samples_per_step: int = Field(default=4, ge=0, le=64, description="sample trajectories logged a step")

    @field_validator("dir")
    @classmethod
    def _relative(cls, v: str | None) -> str | None:
        if v is not None and (PurePosixPath(v).is_absolute() or ".." in PurePosixPath(v).parts or "\\" in v):
            raise ValueError("must be a relative folder inside the run's folder (no '..', not absolute)")
        return v


class RunRequest(Generation):
    run_key: str | None = Field(default=None, max_length=200, description="client idempotency key")
    dataset: DatasetSpec
    sampling: SamplingParams = Field(default_factory=lambda: SamplingParams(n=4))
    estimator: Estimator = "grpo"
    estimator_params: EstimatorParamsUnion = Field(
        default=None, validate_default=True, description="the estimator's params (its model's fields)"
    )
    loss: LossSpec = Field(default_factory=LossSpec)
    schedule: Schedule = Field(default_factory=Schedule)
    filter_groups: str | None = Field(
        default=None,
        max_length=64,
        description="DAPO's dynamic sampling (verl's algorithm.filter_groups): leave out of each update "
        "the groups whose reward component of this name (one of reward.components, or 'reward' for "
        "the summed total) is the same for every response; None trains every group",
    )
    filter_max_batches: int = Field(
        default=1,
        ge=1,
        le=16,
        description="with filter_groups: batches of prompts a step may draw until batch_size groups pass "
        "the filter (DAPO's re-sampling, verl's max_num_gen_batches); the step trains on at most batch_size "
        "of them, or on fewer when the last batch is drawn; 1 = no further batch",
    )
    initial_policy_version: int = Field(
        default=0,
        ge=0,
        le=MAX_VERSION,
        description="the run's base (docs/security.md \"Runs' lineages\"): 0, the deployment's base "
        "model; else that version of policy_namespace, exactly (a full checkpoint)",
    )
    policy_namespace: str | None = Field(
        default=None,
        max_length=64,
        description="the namespace initial_policy_version is numbered in: only this key's own (its "
        "published versions); None: the deployment's. The run trains in a namespace of its own",
    )
    trackers: list[TrackerSpec] | None = Field(
        default=None,
        max_length=3,
        description="experiment trackers of this run (docs/trackers.md); None: the gateway's LOOM_TRACKERS",
    )

    @field_validator("trackers")
    @classmethod
    def _usable_trackers(cls, v: list[TrackerSpec] | None) -> list[TrackerSpec] | None:
        names = [t.name for t in v or []]
        if len(set(names)) != len(names):
            raise ValueError(f"each tracker at most once, got {names}")
        for t in v or []:
            if t.tracking_uri is not None:
                raise ValueError(f"{t.name}: tracking_uri is an operator setting (LOOM_TRACKERS)")
            if not tracker_installed(t.name):
                raise ValueError(
                    f"tracker {t.name!r} is not installed on this gateway (pip install 'loom-rl[{t.name}]')"
                )
        return v

    _tag_estimator_params = field_validator("estimator_params", mode="before")(tagged_params)

    @field_validator("filter_groups")
    @classmethod
    def _filter_names_a_component(cls, v: str | None, info: ValidationInfo) -> str | None:
        reward = info.data.get("reward")
        if v is None or reward is None:  # no filter, or the reward spec already failed validation
            return v
        names = [c.name for c in reward.components]
        if v != TOTAL_REWARD and v not in names:
            raise ValueError(
                f"{v!r} is neither a reward component of this run ({', '.join(names)}) "
                f"nor {TOTAL_REWARD!r} (the summed reward)"
            )
        return v

    @field_validator("filter_max_batches")
    @classmethod
    def _batches_need_a_filter(cls, v: int, info: ValidationInfo) -> int:
        if v > 1 and info.data.get("filter_groups") is None:
            raise ValueError("further batches are drawn only for a filter: set filter_groups")
        return v


class RunView(Contract):
    id: str
    status: RunStatus
    completed_steps: int
    total_steps: int
    policy_version: int
    lineage: Lineage = Field(description="the run's namespace and base (docs/security.md)")
    versions: list[int] = Field(
        default_factory=list, description="the versions the run's steps published in its namespace"
    )
    batch_size: int
    error: str | None = None
    last_metrics: dict[str, float] = Field(default_factory=dict)


class DatasetInfo(Contract):
    id: str = Field(description="the dataset's id, for a run's dataset.id (the SHA-256 of its content)")
    n_items: int


class Created(Contract):
    id: str
    created: bool = Field(description="false when the idempotency key named an existing job/run")


def lineage_of(run_id: str, req: RunRequest) -> Lineage:
    """The lineage run ``run_id`` trains: its own namespace, from the base its request names."""
    return Lineage(
        namespace=run_namespace(run_id),
        base_namespace=req.policy_namespace if req.initial_policy_version else None,  # 0: the base model
        base_version=req.initial_policy_version,
    )
