"""One RL step, read against docs/algorithms.md: sample -> generate -> revise (§3) -> score -> adaptive
rounds (§4) -> filter (§5.3) -> TrainBatch -> train.

Transport-free: every service call is a ``Stages`` method, one group at a time, so a group's next
stage starts as soon as its last one is done (a group's score runs while other groups still generate).
Two implementations: ``gateway.pipeline.CeleryStages`` (the product: the services' Celery tasks by
name) and ``launch.inprocess.InProcessStages`` (the services' cores in this process: the paper benches
and the tests). The gateway's runs (gateway/runs.py) and jobs (gateway/jobs.py) and every paper bench
(bench/rl_loop.py) call the functions below, so a bench measures the step a user's run takes.

Keys: every stage call carries a deterministic key ``<scope>.<...>`` (run or job id, step, draw,
prompt, round, stage), so a re-walked step finds its stored results (docs/architecture.md "The unit of
work").

Reflection is a stage the step orchestrates: the reflect service cuts and returns the revision
requests (``Stages.cut``; the gold detector's chunks are checked by ``Stages.match`` first), the step
generates them with the run's policy, the reflect service assembles the drafts (``Stages.revised``),
and the step scores the revised group ONCE with the run's reward spec before the keep rule
(loom.revisions). A group costs at most two reward calls: the gold detector's match and its score.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from gateway.adaptive import AdaptiveCounters, AdaptiveParams, Rounds, merge_group, select
from loom.batching import differs
from loom.contracts.wire import (
    Group,
    Lineage,
    LossSpec,
    ReflectParams,
    RevisionPlan,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    StepResult,
    TrainBatch,
)
from loom.revisions import keep_revisions, reflect_meta

R = TypeVar("R")
Scored = tuple[Group, RewardResult]


class Stages(Protocol):
    """The services one step calls, one group per call; ``key`` names the call (module docstring)."""

    async def generate(self, key: str, request: RolloutRequest) -> Group: ...

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult: ...

    async def match(self, key: str, group: Group, texts: list[str]) -> list[bool]:
        """Does each text state the group's gold answer (the reward service's gold detector)?"""
        ...

    async def cut(
        self, key: str, group: Group, params: ReflectParams, verdicts: list[bool] | None
    ) -> RevisionPlan:
        """The reflect service's plan for ``group``: its chunks to match, or its revision requests."""
        ...

    async def revised(
        self, key: str, group: Group, params: ReflectParams, plan: RevisionPlan, completions: list[Group]
    ) -> Group:
        """``group`` with the draft revisions ``completions`` complete, after their originals."""
        ...

    async def train(self, key: str, batch: TrainBatch) -> StepResult: ...

    async def cancel(self, scope: str) -> int:
        """Skip the work of job or run ``scope`` still queued; returns how many tasks."""
        ...

    def forget(self, scope: str) -> None:
        """``scope`` has ended: drop what was kept for ``cancel``."""
        ...


async def gather_all(aws: Iterable[Awaitable[R]]) -> list[R]:
    """``asyncio.gather`` that cancels the others when one fails (and re-raises that failure as it is,
    not wrapped in an ExceptionGroup as a TaskGroup would)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()


@dataclass(frozen=True)
class StepConfig:
    """What one step reads of a run (or a job, or a bench's arm)."""

    reward: RewardSpec = field(default_factory=RewardSpec)
    estimator: str = "grpo"
    estimator_params: Any = None  # the run's typed params (its request parsed them), or a dict
    loss: LossSpec = field(default_factory=LossSpec)
    adaptive: AdaptiveParams | None = None
    reflect: ReflectParams | None = None
    filter_groups: str | None = None  # DAPO's dynamic sampling: the reward component that must differ
    filter_max_batches: int = 1  # batches a step may draw until enough groups pass the filter

    @classmethod
    def of(cls, req: Any) -> StepConfig:
        """A ``RunRequest``'s or ``JobRequest``'s step (a job trains nothing: no estimator, no filter)."""
        reflect = req.reflect
        return cls(
            reward=req.reward,
            estimator=getattr(req, "estimator", "grpo"),
            estimator_params=getattr(req, "estimator_params", None),
            loss=getattr(req, "loss", None) or LossSpec(),
            adaptive=req.adaptive,
            reflect=ReflectParams() if reflect is True else (reflect or None),
            filter_groups=getattr(req, "filter_groups", None),
            filter_max_batches=getattr(req, "filter_max_batches", 1),
        )


# --------------------------------------------------------------------------------------------------
# One group: generate -> (revise) -> score


def rollout_request(
    base: RolloutRequest,
    group_id: str,
    n: int,
    policy_version: int | None,
    round_: int = 0,
    policy_namespace: str | None = None,
) -> RolloutRequest:
    sampling = base.sampling.model_copy(update={"n": n})
    if sampling.seed is not None:  # a new round must not repeat the previous round's samples
        sampling = sampling.model_copy(update={"seed": sampling.seed + 1000 * round_})
    update: dict[str, Any] = {"group_id": group_id, "sampling": sampling}
    if policy_version is not None:
        update["policy_version"] = policy_version
    if policy_namespace is not None:  # a run's lineage: its namespace's version (Lineage.at)
        update["policy_namespace"] = policy_namespace
    return base.model_copy(update=update)


async def revise(
    stages: Stages, key: str, group: Group, request: RolloutRequest, params: ReflectParams
) -> Group:
    """REA-RL's revisions of ``group`` (docs/algorithms.md §3), drafted but not scored: the reflect
    service cuts, the policy that generated ``group`` completes each cut."""
    if params.seed is None and request.sampling.seed is not None:  # seeded runs revise reproducibly
        params = params.model_copy(update={"seed": request.sampling.seed + 1})
    plan = await stages.cut(f"{key}.cut", group, params, None)
    if plan.match_texts:
        verdicts = await stages.match(f"{key}.match", group, plan.match_texts)
        plan = await stages.cut(f"{key}.cut2", group, params, verdicts)
    if not plan.requests:  # nothing to revise: the group as it is, with what reflection found
        return group.model_copy(
            update={"meta": {**group.meta, "reflect": reflect_meta(params.detector, plan.revisions)}}
        )
    at = {
        "policy_version": request.policy_version,
        "policy_namespace": request.policy_namespace,
        "policy_match": request.policy_match,
    }
    completions = await gather_all(
        stages.generate(f"{key}.rev{k}", r.model_copy(update=at)) for k, r in enumerate(plan.requests)
    )
    return await stages.revised(f"{key}.revised", group, params, plan, completions)


async def scored_group(stages: Stages, key: str, request: RolloutRequest, cfg: StepConfig) -> Scored:
    """One prompt's group, generated, revised when ``cfg.reflect``, scored once with ``cfg.reward``."""
    group = await stages.generate(key, request)
    if cfg.reflect is not None:
        group = await revise(stages, key, group, request, cfg.reflect)
    result = await stages.score(f"{key}.score", group, cfg.reward)
    if cfg.reflect is not None:
        group, result = keep_revisions(group, result, cfg.reflect.keep_discarded)
    return group, result


# --------------------------------------------------------------------------------------------------
# One batch of prompts -> scored groups (uniform n, or Reinforce-Ada rounds)


@dataclass
class Collected:
    groups: list[Scored | None]  # per prompt; None = dropped
    counters: dict[str, float]
    sampled: list[Scored]  # every group generated (all rounds), for metrics
    seconds: float


async def collect(
    stages: Stages,
    key_prefix: str,
    requests: Sequence[RolloutRequest],
    cfg: StepConfig,
    policy_version: int | None = None,
    policy_namespace: str | None = None,
) -> Collected:
    """Scored groups for ``requests``: one round of ``sampling.n`` each, or adaptive rounds (§4), at
    ``policy_version`` of ``policy_namespace`` (a run's lineage) or, both None, each request's own."""
    t0 = time.perf_counter()
    sampled: list[Scored] = []
    adaptive = cfg.adaptive
    if adaptive is None:
        results = await gather_all(
            scored_group(
                stages,
                f"{key_prefix}.p{i}",
                rollout_request(r, f"{key_prefix}.p{i}", r.sampling.n, policy_version, 0, policy_namespace),
                cfg,
            )
            for i, r in enumerate(requests)
        )
        sampled.extend(results)
        counters = AdaptiveCounters(
            prompts=len(requests), samples=sum(len(g.trajectories) for g, _ in results)
        )
        return Collected(list(results), counters.as_dict(), sampled, time.perf_counter() - t0)

    per_prompt: list[list[Scored]] = [[] for _ in requests]
    rounds: Rounds[tuple[int, int]] = Rounds(len(requests), adaptive)
    while not rounds.done:
        active, rnd = rounds.active, rounds.round
        results = await gather_all(
            scored_group(
                stages,
                f"{key_prefix}.p{i}.r{rnd}",
                rollout_request(
                    requests[i],
                    f"{key_prefix}.p{i}.r{rnd}",
                    adaptive.samples_per_round,
                    policy_version,
                    rnd,
                    policy_namespace,
                ),
                cfg,
            )
            for i in active
        )
        batches = []
        for i, (group, result) in zip(active, results, strict=True):
            per_prompt[i].append((group, result))
            sampled.append((group, result))
            by_id = {r.trajectory_id: r.total for r in result.rewards}
            batches.append([(by_id.get(t.id, 0.0), (i, j)) for j, t in enumerate(group.trajectories)])
        rounds.add(batches)
    pools, counters = rounds.finish()
    chosen = select(pools, adaptive, counters)
    groups: list[Scored | None] = []
    for i, choice in enumerate(chosen):
        if choice is None:
            groups.append(None)
            continue
        _, kept = choice
        groups.append(
            merge_group(f"{key_prefix}.p{i}", per_prompt[i], kept, pools[i].stats(adaptive.threshold))
        )
    return Collected(groups, counters.as_dict(), sampled, time.perf_counter() - t0)


def merge_collected(a: Collected, b: Collected) -> Collected:
    """Two batches of one step as one: their groups in order, their counters summed (the rounds used:
    the larger; samples per prompt: recomputed)."""
    counters = dict(a.counters)
    for k, v in b.counters.items():
        counters[k] = (
            max(counters.get(k, 0.0), v) if k == "adaptive_rounds_used" else counters.get(k, 0.0) + v
        )
    if counters.get("adaptive_prompts"):
        counters["adaptive_samples_per_prompt"] = counters["adaptive_samples"] / counters["adaptive_prompts"]
    return Collected([*a.groups, *b.groups], counters, [*a.sampled, *b.sampled], a.seconds + b.seconds)


# --------------------------------------------------------------------------------------------------
# One step: draws until the filter is satisfied -> the groups trained -> TrainBatch -> train


def passing(collected: Collected, cfg: StepConfig) -> list[Scored]:
    """The kept groups, or with ``cfg.filter_groups`` those whose responses differ in that reward
    component (DAPO's dynamic sampling, docs/algorithms.md §5.3; loom.batching.differs)."""
    kept = [g for g in collected.groups if g is not None]
    if cfg.filter_groups is None:
        return kept
    return [(g, r) for g, r in kept if differs(r, cfg.filter_groups)]


async def generate_step(
    stages: Stages,
    cfg: StepConfig,
    key: str,
    draw: Callable[[int], Sequence[RolloutRequest]],
    batch_size: int,
    policy_version: int | None = None,
    policy_namespace: str | None = None,
) -> Collected:
    """A step's scored groups: the prompts of ``draw(0)``, then with ``cfg.filter_groups`` further
    draws (up to ``cfg.filter_max_batches``: DAPO's re-sampling) until ``batch_size`` groups pass."""
    collected = await collect(stages, key, draw(0), cfg, policy_version, policy_namespace)
    draws = 1
    while draws < cfg.filter_max_batches and len(passing(collected, cfg)) < batch_size:
        collected = merge_collected(
            collected,
            await collect(stages, f"{key}.b{draws}", draw(draws), cfg, policy_version, policy_namespace),
        )
        draws += 1
    collected.counters["gen_batches"] = float(draws)
    return collected


def trained_groups(collected: Collected, cfg: StepConfig, batch_size: int) -> list[Scored]:
    """The groups a step trains on: the first ``batch_size`` that pass (:func:`passing`)."""
    return passing(collected, cfg)[:batch_size]


def train_batch(
    step: int, kept: Sequence[Scored], cfg: StepConfig, lineage: Lineage | None = None
) -> TrainBatch:
    """The learner's batch of ``kept``. The adaptive-sampling threshold stays in the config and in
    each group's pool statistics (``n_positive``); no estimator reads it, so the batch does not carry it."""
    return TrainBatch(
        step=step,
        lineage=lineage,
        groups=[g for g, _ in kept],
        rewards=[r for _, r in kept],
        estimator=cfg.estimator,  # type: ignore[arg-type]
        estimator_params=cfg.estimator_params,
        loss=cfg.loss,
    )


@dataclass
class Trained:
    batch: TrainBatch | None  # None: nothing to train (every group dropped or filtered out)
    result: StepResult | None


async def train(
    stages: Stages,
    key: str,
    step: int,
    kept: Sequence[Scored],
    cfg: StepConfig,
    lineage: Lineage | None = None,
) -> Trained:
    """Train ``kept`` (on ``lineage``: a run's); an empty step trains nothing and the policy stays."""
    if not kept:
        return Trained(None, None)
    batch = train_batch(step, kept, cfg, lineage)
    return Trained(batch, await stages.train(key, batch))


@dataclass
class StepOutcome:
    collected: Collected
    kept: list[Scored]
    trained: Trained


async def rl_step(
    stages: Stages,
    cfg: StepConfig,
    scope: str,
    step: int,
    draw: Callable[[int], Sequence[RolloutRequest]],
    batch_size: int,
    policy_version: int | None = None,
) -> StepOutcome:
    """One synchronous step (generate, then train on it): the benches' loop. The gateway's run loop
    calls the same pieces with generation ahead of training (gateway/runs.py, one-step off-policy)."""
    collected = await generate_step(stages, cfg, f"{scope}.s{step}", draw, batch_size, policy_version)
    kept = trained_groups(collected, cfg, batch_size)
    return StepOutcome(collected, kept, await train(stages, f"{scope}.train.s{step}", step, kept, cfg))
