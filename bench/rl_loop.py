"""The paper benches' configuration (bench/adasr.py, bench/rea.py) over the product's RL step: each step
is ``gateway.step.rl_step`` (the step a user's run takes: generate, revise, score once, filter, train)
through ``launch.inprocess.InProcessStages`` (the services' cores in this process, the torch engine,
one ``learner.train.Learner``). Reporting is bench/rl_report.py.

Every arm starts from the same checkpoint, sees the same prompts in the same order and samples with the
same seeds (per step and prompt); only its reward spec, estimator and revisions differ. Held-out
accuracy is greedy decoding of test-split problems, before training (once: every arm starts there) and
after each arm; with ``eval_samples``, also responses sampled at the training temperature.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.rl_report import ArmResult, Eval, StepLog, step_line, weight_change
from loom.contracts.wire import Group, LossSpec, ReflectParams, RewardSpec, RolloutRequest, SamplingParams

CACHE_ENTRIES = 256  # the engine's prefix KV cache: one entry per live sequence of a step (8 x 8)
MakeRequest = Callable[[Any, SamplingParams, str], RolloutRequest]  # (problem, sampling, group id)
Measure = Callable[[Group], list[dict[str, float]]]  # per-trajectory measures, the same keys


@dataclass
class LoopConfig:
    model: Path
    steps: int
    prompts: int  # per step
    group: int  # responses per prompt
    seed: int
    lr: float
    temperature: float
    max_tokens: int
    eval_prompts: int
    warmup: int = 0
    filter_groups: str | None = None  # DAPO's dynamic sampling without re-sampling (one draw a step)
    eval_samples: int = 0  # held-out responses per problem sampled at ``temperature`` (0: greedy only)

    def sampling(self, step: int, prompt: int) -> SamplingParams:
        """The same seed for (step, prompt) in every arm."""
        seed = (self.seed * 1_000_003 + step * 10_007 + prompt * 101) % (2**31)
        return SamplingParams(
            n=self.group, temperature=self.temperature, max_tokens=self.max_tokens, seed=seed
        )

    def eval_sampling(self) -> SamplingParams | None:
        """Held-out sampling at the training temperature (the policy RL trains is the sampled one),
        the same seeds before and after every arm; None without ``eval_samples``."""
        if self.eval_samples <= 0:
            return None
        return SamplingParams(
            n=self.eval_samples,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            seed=7_000_003 * (self.seed + 1),
        )


@dataclass
class Arm:
    name: str
    estimator: str
    spec: RewardSpec
    estimator_params: dict[str, Any] = field(default_factory=dict)
    reflect: ReflectParams | None = None  # REA-RL: revisions, scored with ``spec`` once
    loss: dict[str, Any] = field(default_factory=dict)  # LossSpec fields of this arm (e.g. hrpo_lambda)
    eval_spec: RewardSpec | None = None  # the held-out accuracy's spec (None: ``spec``)


def engine_for(cfg: LoopConfig) -> Any:
    from rollout_svc.engines.torch import TorchEngine

    # processed log-probs: the tempered policy's, which the learner recomputes at loss.temperature
    return TorchEngine(cfg.model, logprobs_mode="processed", cache_entries=CACHE_ENTRIES)


def _means(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]} if rows else {}


def originals(group: Group) -> Group:
    return group.model_copy(
        update={"trajectories": [t for t in group.trajectories if "revision_of" not in t.meta]}
    )


def evaluate(
    stages: Any,
    problems: Sequence[Any],
    make: MakeRequest,
    spec: RewardSpec,
    measure: Measure,
    max_tokens: int,
    sampled: SamplingParams | None = None,
) -> Eval:
    """Greedy decoding of each problem: accuracy (the reward core's accuracy component), measures;
    with ``sampled``, also the accuracy of that many responses per problem (problem i's seed
    ``sampled.seed + i``)."""
    from gateway.step import gather_all

    def accuracy(params: SamplingParams, tag: str) -> tuple[float, list[Group]]:
        requests = [
            make(
                p,
                params if params.seed is None else params.model_copy(update={"seed": params.seed + i}),
                f"{tag}{i}",
            )
            for i, p in enumerate(problems)
        ]
        groups = asyncio.run(gather_all(stages.generate(r.group_id, r) for r in requests))
        scores = [
            r.components.get("accuracy", 0.0) for g in groups for r in stages.scorer.score(g, spec).rewards
        ]
        return statistics.fmean(scores), groups

    greedy, groups = accuracy(SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens), "eval")
    at_temperature = accuracy(sampled, "evals")[0] if sampled is not None else None
    return Eval(greedy, _means([m for g in groups for m in measure(g)]), at_temperature)


def run_arm(
    cfg: LoopConfig,
    arm: Arm,
    train: Sequence[Any],
    held_out: Sequence[Any],
    make: MakeRequest,
    measure: Measure,
    log: Callable[[str], None] = print,
) -> ArmResult:
    """``cfg.steps`` RL steps of ``arm`` from ``cfg.model``; prompts ``train[step*P:(step+1)*P]``."""
    from gateway.step import StepConfig, rl_step
    from launch.inprocess import InProcessStages
    from learner.config import LearnerSettings
    from learner.train import Learner

    t0 = time.perf_counter()
    engine = engine_for(cfg)
    loss = LossSpec(lr=cfg.lr, temperature=cfg.temperature, warmup_steps=cfg.warmup, **arm.loss)
    step_cfg = StepConfig(
        arm.spec, arm.estimator, arm.estimator_params, loss, None, arm.reflect, cfg.filter_groups
    )
    steps: list[StepLog] = []
    with tempfile.TemporaryDirectory(prefix=f"loom-{arm.name}-") as tmp:
        learner = Learner(
            LearnerSettings(model=cfg.model, store=Path(tmp), save_optimizer=False, keep_versions=1)
        )
        stages = InProcessStages(engine, learner)
        start = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        for step in range(cfg.steps):
            ts = time.perf_counter()
            problems = train[step * cfg.prompts : (step + 1) * cfg.prompts]

            def draw(_: int, step: int = step, problems: Sequence[Any] = problems) -> list[RolloutRequest]:
                return [make(p, cfg.sampling(step, i), f"s{step}p{i}") for i, p in enumerate(problems)]

            out = asyncio.run(rl_step(stages, step_cfg, arm.name, step, draw, cfg.prompts))
            sampled = [(originals(g), r) for g, r in out.collected.sampled]
            by_id = [{r.trajectory_id: r for r in res.rewards} for _, res in sampled]
            rewards = [ids[t.id] for (g, _), ids in zip(sampled, by_id, strict=True) for t in g.trajectories]
            result = out.trained.result
            entry = StepLog(
                step=step,
                reward=statistics.fmean(r.total for r in rewards),
                accuracy=statistics.fmean(r.components.get("accuracy", 0.0) for r in rewards),
                means=_means([m for g, _ in sampled for m in measure(g)]),
                skipped=result is None or bool(result.metrics.get("skipped")),
                seconds=time.perf_counter() - ts,
                revisions=sum("revision_of" in t.meta for g, _ in out.kept for t in g.trajectories),
                trained_groups=len(out.kept),
            )
            steps.append(entry)
            log(step_line(arm, entry, cfg))
        change = weight_change(start, learner.model.state_dict())
    after = evaluate(
        stages, held_out, make, arm.eval_spec or arm.spec, measure, cfg.max_tokens, cfg.eval_sampling()
    )
    stages.close()
    engine.stop_scheduler()
    return ArmResult(arm, steps, after, change, engine.policy_version, time.perf_counter() - t0)


def base_eval(
    cfg: LoopConfig, held_out: Sequence[Any], make: MakeRequest, spec: RewardSpec, measure: Measure
) -> Eval:
    from launch.inprocess import InProcessStages

    engine = engine_for(cfg)
    stages = InProcessStages(engine)
    try:
        return evaluate(stages, held_out, make, spec, measure, cfg.max_tokens, cfg.eval_sampling())
    finally:
        stages.close()
        engine.stop_scheduler()


def problems_for(model: str, n: int, seed: int, split: str, kind: str = "countdown") -> list[Any]:
    """The model's own problems: the search and stream models' Countdown (zoo.search), else the
    tiny model's."""
    if model in ("search", "stream", "reflect") or "search" in Path(model).parts[-3:]:
        from zoo.search import search_problems

        return search_problems(kind, n, seed, split)  # type: ignore[arg-type]
    from zoo.tiny import tiny_problems

    return tiny_problems(kind, n, seed, split)  # type: ignore[arg-type]


def countdown_label(problem: Any) -> tuple[str, str]:
    """(label, task) as the gateway's built-in datasets give them (reward_svc's exact verifiers)."""
    import json

    if problem.kind == "countdown":
        return json.dumps({"numbers": list(problem.numbers), "target": problem.target}), "countdown"
    return problem.gold, "arithmetic"
