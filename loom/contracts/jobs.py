"""The gateway's job and run contracts that a trainer's client reads too: the generation fields a
job and a run share with a rollout request (``Generation``, with ``PolicyAt`` from the wire), a job's
items, Reinforce-Ada's ``AdaptiveParams``, and what a job answers (``ScoredGroup``, ``JobView``).
Here, not in the gateway, so ``loom/clients/rollouts.py`` parses the gateway's answers with the
gateway's own models (docs/architecture.md, "Contracts"); ``gateway/models.py`` derives its
``JobRequest`` and ``RunRequest`` from these."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from loom.contracts.wire import (
    Contract,
    Group,
    Mode,
    Params,
    ReflectParams,
    RewardResult,
    RewardSpec,
    SamplingParams,
    TaskKind,
)

ExitRule = Literal["positive", "balanced"]
FillOrder = Literal["first", "random"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]


class AdaptiveParams(Contract):
    """Reinforce-Ada's hyper-parameters with docs/algorithms.md §4 defaults, written once: the run's
    and the job's ``adaptive`` field and the rounds of gateway/adaptive.py read this one model."""

    n: int = Field(default=4, ge=1, le=256, description="update group size (kept responses per prompt)")
    samples_per_round: int = Field(default=8, ge=1, le=256, description="M")
    max_rounds: int = Field(default=4, ge=1, le=32, description="R")
    threshold: float = Field(default=0.7, ge=-1e6, le=1e6, description="positive iff reward > threshold")
    exit: ExitRule = "balanced"
    fill: FillOrder = "first"
    seed: int = Field(default=0, ge=0, le=2**31 - 1, description="the random fill's seed")

    @model_validator(mode="after")
    def _can_fill(self) -> AdaptiveParams:
        if self.samples_per_round * self.max_rounds < self.n:
            raise ValueError(
                f"samples_per_round * max_rounds = {self.samples_per_round * self.max_rounds} can never "
                f"fill an update group of n = {self.n}"
            )
        return self


class Generation(Contract):
    """How every prompt of a job or a run is generated and scored: the fields both share with a
    ``RolloutRequest`` (mode, mode_params, sampling) and the stages around it (reward, adaptive
    sampling, REA-RL revisions)."""

    mode: Mode = "plain"
    mode_params: Params = Field(default_factory=dict)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    adaptive: AdaptiveParams | None = None
    reflect: bool | ReflectParams = Field(
        default=False,
        description="REA-RL revisions (docs/algorithms.md §3): the reflection params, or true for their "
        "defaults; the revised group is scored once with this request's reward spec (ReflectParams.reward "
        "is /v1/reflect's own)",
    )

    def generated_sampling(self) -> SamplingParams:
        """The sampling each of its rollout requests is generated with, which a mode's request
        defaults follow: adaptive rounds generate ``samples_per_round`` responses a request
        (gateway/step.py, docs/algorithms.md §4)."""
        if self.adaptive is None:
            return self.sampling
        return self.sampling.model_copy(update={"n": self.adaptive.samples_per_round})


class TaskItem(Contract):
    prompt: str = Field(min_length=1, max_length=100_000)
    label: str | None = None
    task: TaskKind | None = None
    mode_params: Params = Field(
        default_factory=dict, description="per-item mode parameters (e.g. streaming sentences)"
    )


class ScoredGroup(Contract):
    """One prompt's result as a job stores, answers and streams it."""

    index: int
    group: Group | None = Field(default=None, description="None: dropped by adaptive sampling")
    rewards: RewardResult | None = None


class JobView(Contract):
    id: str
    job_key: str
    status: JobStatus
    n_prompts: int
    n_done: int
    error: str | None = None
    counters: dict[str, float] = Field(default_factory=dict)
    groups: list[ScoredGroup] = Field(
        default_factory=list, description="one page of the stored groups, in prompt order, from `offset`"
    )
    offset: int = Field(default=0, description="the page's first group among the stored ones")
    next_offset: int | None = Field(default=None, description="the next page's offset; None: the last page")
