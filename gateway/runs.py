"""The RL run loop (docs/architecture.md "Policy versions"; docs/algorithms.md §5.3): sample prompts
-> rollout groups -> rewards -> optional reflection -> optional adaptive rounds -> learner step -> new
policy version.

One-step off-policy (staleness bound s, default 1): while the learner trains step m, generation of
steps up to m + s runs with the newest policy version available when it starts (version v0 + m), so
the data of step k is at most s versions behind the policy it updates; s = 0 is the synchronous loop.

Resume: the run's completed steps, policy version and batch size change in one SQLite transaction per
step; each step's batch size and generation version are fixed in ``run_plans`` before generation, and
every task key is derived from (run, step, prompt, round). A restarted gateway therefore re-walks the
first uncompleted step with the same prompts and keys: finished rollouts and a finished train step
return their stored results, nothing is trained twice and no step is skipped.

The loop is a coroutine (gateway/manager.py runs it beside every other job and run on one event loop):
waiting on generation or training holds futures, not threads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway import step as rl
from gateway.datasets import load_dataset, step_indices
from gateway.models import RunRequest, TaskItem, lineage_of
from gateway.pipeline import Cancelled
from gateway.state import GatewayState
from gateway.step import Collected, Stages, StepConfig
from gateway.stepmetrics import has_signal, step_metrics, step_samples
from gateway.trackers import Trackers, resolve
from loom.batching import next_batch_size
from loom.contracts.modes import ModeLimits, resolved_request
from loom.contracts.settings import get_settings
from loom.contracts.wire import Group, RewardResult, RolloutRequest

log = logging.getLogger("loom.gateway.runs")

WAIT_POLL_S = 0.5  # how often a run waiting on its generation looks for a cancel
SAMPLE_GROUPS = 4  # scored groups stored per step for the run page (RunStore.samples)


@dataclass(frozen=True)
class Position:
    """Where a run stands: its first uncompleted step, the policy version and batch size it starts
    with, and the steps it has in all."""

    step: int
    version: int
    batch: int
    total: int


@dataclass
class Generated:
    step: int
    batch_size: int  # as planned (``RunStore.plan``): a resumed step keeps its first plan
    gen_version: int
    collected: Collected
    wait_seconds: float = 0.0  # how long training waited for it


@dataclass(frozen=True)
class Trained:
    version: int  # the policy version after the step
    learner_metrics: dict[str, float]
    seconds: float
    next_batch: int  # the next step's batch size


class LookAhead:
    """Generation ahead of training: while step m trains, steps up to m + ``staleness`` generate, each
    with the newest policy version when it is planned (module docstring)."""

    def __init__(self, generate: Callable[[int, int, int], Awaitable[Generated]], staleness: int) -> None:
        self.generate = generate
        self.staleness = staleness
        self.tasks: dict[int, asyncio.Task[Generated]] = {}

    def plan(self, at: Position) -> None:
        for k in range(at.step, min(at.total, at.step + self.staleness + 1)):
            if k not in self.tasks:
                self.tasks[k] = asyncio.ensure_future(self.generate(k, at.batch, at.version))

    def cancel(self) -> None:
        for task in self.tasks.values():
            task.cancel()


def record_metrics(at: Position, gen: Generated, trained: Trained) -> dict[str, Any]:
    """The metrics a step records (``/v1/runs/{id}/metrics``, metrics.jsonl, trackers)."""
    collected = gen.collected
    oldest = min(
        (t.policy_version for g, _ in collected.sampled for t in g.trajectories), default=gen.gen_version
    )
    return {
        "step": at.step,
        "policy_version": trained.version,
        "gen_policy_version": gen.gen_version,
        "staleness": at.version - gen.gen_version,
        "staleness_observed": at.version - oldest,
        "batch_size": gen.batch_size,
        "next_batch_size": trained.next_batch,
        "train_seconds": trained.seconds,
        "wait_gen_seconds": gen.wait_seconds,
        "time": time.time(),
        **step_metrics(collected.groups, collected.sampled, collected.seconds),
        **collected.counters,
        **trained.learner_metrics,
    }


def to_request(item: TaskItem, req: RunRequest | Any) -> RolloutRequest:
    return RolloutRequest(
        mode=req.mode,
        prompt=item.prompt,
        label=item.label,
        task=item.task,
        sampling=req.sampling,
        mode_params={**req.mode_params, **item.mode_params},
    )


class RunLoop:
    def __init__(
        self,
        run_id: str,
        state: GatewayState,
        stages: Stages,
        data_dir: Path,
        stop: threading.Event | None = None,
        trackers: Trackers | None = None,
    ) -> None:
        """``trackers``: already open ones to log to instead of the run's own (tests)."""
        self.run_id = run_id
        self.state = state
        self.stages = stages
        self.stop = stop or threading.Event()
        row = state.runs.get(run_id)
        if row is None:
            raise KeyError(run_id)
        self.req = RunRequest.model_validate(row.config)
        self.lineage = lineage_of(run_id, self.req)  # every version it trains is its own
        self.dataset: Sequence[TaskItem] = load_dataset(self.req.dataset, self.req.mode, data_dir)
        self.cfg = StepConfig.of(self.req)
        self.run_dir = data_dir / "runs" / run_id
        self.jsonl = self.run_dir / "metrics.jsonl"
        try:
            self.tracker_specs = resolve(self.req.trackers, get_settings().trackers)
        except ValueError:  # a bad LOOM_TRACKERS entry: the run goes on without trackers
            log.exception("run %s: LOOM_TRACKERS cannot be read; no trackers", run_id)
            self.tracker_specs = []
        if trackers is not None:
            self.tracker_specs = []
        self.trackers = trackers or Trackers([])

    # ---------------------------------------------------------------------------------------- stages
    async def generate(self, step: int, batch_size: int, gen_version: int) -> Generated:
        """Step ``step``'s scored groups (gateway.step.generate_step). Every batch's rows and task keys
        are fixed by (seed, step, batch), and the batch size and generation version by the step's plan
        (``RunStore.plan``), so a resumed step re-walks them."""
        batch_size, gen_version = await asyncio.to_thread(
            self.state.runs.plan, self.run_id, step, batch_size, gen_version
        )

        def draw(k: int) -> list[RolloutRequest]:
            rows = step_indices(len(self.dataset), batch_size, self.req.schedule.seed, step, k)
            # parsed here, once per request; the rollout worker takes the resolved form as it is
            return [resolved_request(to_request(self.dataset[i], self.req), limits, sampling) for i in rows]

        limits, sampling = ModeLimits.from_settings(get_settings()), self.req.generated_sampling()

        namespace, version = self.lineage.at(gen_version)  # the base, or the run's own namespace
        collected = await rl.generate_step(
            self.stages, self.cfg, f"{self.run_id}.s{step}", draw, batch_size, version, namespace
        )
        return Generated(step, batch_size, gen_version, collected)

    def trained_groups(self, gen: Generated) -> list[tuple[Group, RewardResult]]:
        """The groups step ``gen.step`` trains on (gateway.step.trained_groups)."""
        return rl.trained_groups(gen.collected, self.cfg, gen.batch_size)

    async def train(
        self, gen: Generated, version: int, kept: list[tuple[Group, RewardResult]]
    ) -> tuple[int, dict[str, float]]:
        """Train step ``gen.step`` on ``kept`` (:meth:`trained_groups`); returns the new policy version
        and the learner's metrics."""
        counted = {"trained_groups": float(len(kept))}
        # No broadcast to the engines: the next step's requests name the new version, and each rollout
        # replica loads it from the policy store before generating (rollout_svc.rollout.catch_up).
        trained = await rl.train(
            self.stages, f"{self.run_id}.train.s{gen.step}", gen.step, kept, self.cfg, self.lineage
        )
        if trained.result is None:  # every prompt dropped (or filtered out): no update, the policy stays
            return version, {"skipped_update": 1.0, **counted}
        result = trained.result
        metrics = {f"learner/{k}": float(v) for k, v in result.metrics.items()}
        metrics["train_tokens"] = float(result.n_tokens)
        return result.policy_version, {**metrics, **counted}

    # ------------------------------------------------------------------------------------------ loop
    async def run(self) -> str:
        """Drive the run to its end (or until ``stop``); returns the final status."""
        if not await asyncio.to_thread(self.state.runs.start, self.run_id):  # cancelled before it started
            return "cancelled"
        await asyncio.to_thread(self._rewrite_jsonl)
        if self.tracker_specs:  # a tracker that cannot open is logged and left out (gateway/trackers.py)
            self.trackers = await asyncio.to_thread(
                Trackers.open, self.tracker_specs, self.run_id, self.run_dir
            )
        status = "failed"
        try:
            status = await self._steps()
            return status
        except asyncio.CancelledError:
            status = "interrupted"
            raise
        finally:
            await asyncio.to_thread(self.trackers.close, status)

    async def _steps(self) -> str:
        """One step after another: plan -> generate -> train -> record, until the run ends."""
        lookahead = LookAhead(self.generate, self.req.schedule.staleness)
        try:
            while True:
                at = await self._position()
                if isinstance(at, str):  # "succeeded" or "cancelled"
                    return at
                lookahead.plan(at)
                gen = await self._generated(lookahead, at.step)
                if gen is None:  # nothing is trained (nor published) for a cancelled run
                    return "cancelled"
                trained = await self._train_step(gen, at)
                await self._record(at, gen, trained)
        except Cancelled:
            return "interrupted"
        except Exception as exc:
            if self._cancelled():  # a cancel wins over the failure of the step it interrupted
                return "cancelled"
            log.exception("run %s failed", self.run_id)
            error = f"{type(exc).__name__}: {exc}"
            await asyncio.to_thread(self.state.runs.finish, self.run_id, "failed", error=error)
            return "failed"
        finally:
            lookahead.cancel()

    async def _position(self) -> Position | str:
        """Where the run stands (its first uncompleted step), or its final status once it has ended."""
        row = self.state.runs.get(self.run_id)
        assert row is not None
        if row.status == "cancelled":
            return "cancelled"
        if row.completed_steps >= row.total_steps:
            await asyncio.to_thread(self.state.runs.finish, self.run_id, "succeeded")
            return "succeeded"
        if self.stop.is_set():
            raise Cancelled("gateway stopping")
        return Position(row.completed_steps, row.policy_version, row.batch_size, row.total_steps)

    async def _generated(self, lookahead: LookAhead, step: int) -> Generated | None:
        """Step ``step``'s generation once it is done; None when the run is cancelled first (seen
        within WAIT_POLL_S, not when the generation ends)."""
        t0 = time.perf_counter()
        task = lookahead.tasks[step]  # in ``lookahead`` until done: ``cancel`` stops what is left
        while not (await asyncio.wait({task}, timeout=WAIT_POLL_S))[0]:
            if self._cancelled():
                return None
            if self.stop.is_set():
                raise Cancelled("gateway stopping")
        del lookahead.tasks[step]
        gen = task.result()
        if self._cancelled():
            return None
        gen.wait_seconds = time.perf_counter() - t0
        return gen

    async def _train_step(self, gen: Generated, at: Position) -> Trained:
        """Train on ``gen`` and choose the next step's batch size (from the groups with a signal when
        the schedule adapts it)."""
        sched = self.req.schedule
        staleness = at.version - gen.gen_version
        if staleness > sched.staleness:  # cannot happen by construction; refuse rather than train
            raise RuntimeError(f"step {at.step}: staleness {staleness} > bound {sched.staleness}")
        kept = self.trained_groups(gen)
        t0 = time.perf_counter()
        version, learner_metrics = await self.train(gen, at.version, kept)
        seconds = time.perf_counter() - t0
        next_batch = at.batch
        if sched.adaptive_batch:  # B''_m: the groups with a signal among those the step trains
            signal = sum(1 for g in kept if has_signal(*g))
            next_batch = next_batch_size(
                gen.batch_size,
                sched.target_groups or sched.batch_size,
                signal,
                lam=sched.batch_lambda,
                minimum=sched.min_batch,
                maximum=sched.max_batch,
            )
        return Trained(version, learner_metrics, seconds, next_batch)

    async def _record(self, at: Position, gen: Generated, trained: Trained) -> None:
        """Store a few scored groups, then the step's metrics and the run's advance (one transaction);
        then the JSONL mirror and the trackers, only when this call recorded the step (a re-walked step
        that was recorded before is not logged twice)."""
        metrics = record_metrics(at, gen, trained)
        kept = gen.collected.groups
        stored = [g for g in kept if g is not None][:SAMPLE_GROUPS]
        runs = self.state.runs
        await asyncio.to_thread(runs.add_samples, self.run_id, at.step, stored)
        if not await asyncio.to_thread(
            runs.complete_step, self.run_id, at.step, metrics, trained.version, trained.next_batch
        ):
            return
        await asyncio.to_thread(self._append_jsonl, metrics)
        log.info("run %s step %d done: reward %.3f", self.run_id, at.step, metrics["reward_mean"])
        if self.trackers.trackers:
            per_step = max((t.samples_per_step for t in self.tracker_specs), default=4)
            samples = step_samples(kept, per_step)
            await asyncio.to_thread(self.trackers.log, at.step, metrics, samples)

    def _cancelled(self) -> bool:
        return self.state.runs.status(self.run_id) == "cancelled"

    def _append_jsonl(self, metrics: dict[str, Any]) -> None:
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(metrics) + "\n")

    def _rewrite_jsonl(self) -> None:
        """The JSONL mirrors the database: rebuilt on (re)start, so a crash between the commit and the
        append cannot leave a step missing or doubled."""
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.jsonl.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in self.state.runs.steps(self.run_id)))
        tmp.replace(self.jsonl)
