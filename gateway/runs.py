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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.adaptive import AdaptiveConfig
from gateway.datasets import load_dataset, step_indices
from gateway.models import RunRequest, TaskItem
from gateway.pipeline import Cancelled, Collected, Stages, collect
from gateway.state import GatewayState
from gateway.stepmetrics import has_signal, step_metrics, step_samples
from gateway.trackers import Trackers, resolve
from loom.batching import next_batch_size
from loom.contracts.settings import get_settings
from loom.contracts.wire import RolloutRequest, TrainBatch

log = logging.getLogger("loom.gateway.runs")

WAIT_POLL_S = 0.5  # how often a run waiting on its generation looks for a cancel
SAMPLE_GROUPS = 4  # scored groups stored per step for the run page (GatewayState.run_samples)


@dataclass
class Generated:
    step: int
    batch_size: int
    gen_version: int
    collected: Collected


def adaptive_config(req: RunRequest | Any) -> AdaptiveConfig | None:
    a = req.adaptive
    if a is None:
        return None
    return AdaptiveConfig(
        n=a.n,
        samples_per_round=a.samples_per_round,
        max_rounds=a.max_rounds,
        threshold=a.threshold,
        exit=a.exit,
        fill=a.fill,
    )


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
        row = state.run(run_id)
        if row is None:
            raise KeyError(run_id)
        self.req = RunRequest.model_validate(json.loads(row["config"]))
        self.dataset: Sequence[TaskItem] = load_dataset(self.req.dataset, self.req.mode, data_dir)
        self.adaptive = adaptive_config(self.req)
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
        batch_size, gen_version = await asyncio.to_thread(
            self.state.plan, self.run_id, step, batch_size, gen_version
        )
        rows = step_indices(len(self.dataset), batch_size, self.req.schedule.seed, step)
        requests = [to_request(self.dataset[i], self.req) for i in rows]
        collected = await collect(
            self.stages,
            f"{self.run_id}.s{step}",
            requests,
            self.req.reward,
            adaptive=self.adaptive,
            policy_version=gen_version,
            reflect=self.req.reflect,
        )
        return Generated(step, batch_size, gen_version, collected)

    async def train(self, gen: Generated, version: int) -> tuple[int, dict[str, float]]:
        """Train step ``gen.step``; returns the new policy version and the learner's metrics."""
        kept = [g for g in gen.collected.groups if g is not None]
        if not kept:  # every prompt dropped: no update, the policy stays
            return version, {"skipped_update": 1.0}
        # the adaptive-sampling threshold stays in the run's config (``adaptive.threshold``) and in each
        # group's pool statistics (``n_positive``); no estimator reads it, so the batch does not carry it
        params = dict(self.req.estimator_params)
        batch = TrainBatch(
            step=gen.step,
            groups=[g for g, _ in kept],
            rewards=[r for _, r in kept],
            estimator=self.req.estimator,
            estimator_params=params,
            loss=self.req.loss,
        )
        # No broadcast to the engines: the next step's requests name the new version, and each rollout
        # replica loads it from the policy store before generating (rollout_svc.rollout.catch_up).
        result = await self.stages.train(f"{self.run_id}.train.s{gen.step}", batch)
        metrics = {f"learner/{k}": float(v) for k, v in result.metrics.items()}
        metrics["train_tokens"] = float(result.n_tokens)
        return result.policy_version, metrics

    # ------------------------------------------------------------------------------------------ loop
    async def run(self) -> str:
        """Drive the run to its end (or until ``stop``); returns the final status."""
        if not await asyncio.to_thread(self.state.start_run, self.run_id):  # cancelled before it started
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
        sched = self.req.schedule
        inflight: dict[int, asyncio.Task[Generated]] = {}
        try:
            while True:
                row = self.state.run(self.run_id)
                assert row is not None
                if row["status"] == "cancelled":
                    return "cancelled"
                step, version, batch = (
                    int(row["completed_steps"]),
                    int(row["policy_version"]),
                    int(row["batch_size"]),
                )
                if step >= int(row["total_steps"]):
                    await asyncio.to_thread(self.state.finish, "runs", self.run_id, "succeeded")
                    return "succeeded"
                if self.stop.is_set():
                    raise Cancelled("gateway stopping")
                # Generation may run ahead up to `staleness` steps, with the newest version now.
                for k in range(step, min(int(row["total_steps"]), step + sched.staleness + 1)):
                    if k not in inflight:
                        inflight[k] = asyncio.ensure_future(self.generate(k, batch, version))
                t_step = time.perf_counter()
                gen_task = inflight[step]  # in `inflight` until done: `finally` cancels what is left
                while True:  # a cancel is seen within WAIT_POLL_S, not when the generation ends
                    done, _ = await asyncio.wait({gen_task}, timeout=WAIT_POLL_S)
                    if done:
                        del inflight[step]
                        gen = gen_task.result()
                        break
                    if self._cancelled():
                        return "cancelled"
                    if self.stop.is_set():
                        raise Cancelled("gateway stopping")
                if self._cancelled():  # nothing is trained (nor published) for a cancelled run
                    return "cancelled"
                staleness = version - gen.gen_version
                if staleness > sched.staleness:  # cannot happen by construction; refuse rather than train
                    raise RuntimeError(f"step {step}: staleness {staleness} > bound {sched.staleness}")
                t_train = time.perf_counter()
                new_version, learner_metrics = await self.train(gen, version)
                train_seconds = time.perf_counter() - t_train
                kept = gen.collected.groups
                signal = sum(1 for g in kept if g is not None and has_signal(*g))
                new_batch = batch
                if sched.adaptive_batch:
                    new_batch = next_batch_size(
                        gen.batch_size,
                        sched.target_groups or sched.batch_size,
                        signal,
                        lam=sched.batch_lambda,
                        minimum=sched.min_batch,
                        maximum=sched.max_batch,
                    )
                metrics: dict[str, Any] = {
                    "step": step,
                    "policy_version": new_version,
                    "gen_policy_version": gen.gen_version,
                    "staleness": staleness,
                    "staleness_observed": version
                    - min(
                        (t.policy_version for g, _ in gen.collected.sampled for t in g.trajectories),
                        default=gen.gen_version,
                    ),
                    "batch_size": gen.batch_size,
                    "next_batch_size": new_batch,
                    "train_seconds": train_seconds,
                    "wait_gen_seconds": t_train - t_step,
                    "time": time.time(),
                    **step_metrics(kept, gen.collected.sampled, gen.collected.seconds),
                    **gen.collected.counters,
                    **learner_metrics,
                }
                stored = [g for g in kept if g is not None][:SAMPLE_GROUPS]
                await asyncio.to_thread(self.state.add_run_samples, self.run_id, step, stored)
                if await asyncio.to_thread(
                    self.state.complete_step, self.run_id, step, metrics, new_version, new_batch
                ):
                    await asyncio.to_thread(self._append_jsonl, metrics)
                    log.info("run %s step %d done: reward %.3f", self.run_id, step, metrics["reward_mean"])
                    if self.trackers.trackers:
                        per_step = max((t.samples_per_step for t in self.tracker_specs), default=4)
                        samples = step_samples(kept, per_step)
                        await asyncio.to_thread(self.trackers.log, step, metrics, samples)
        except Cancelled:
            return "interrupted"
        except Exception as exc:
            if self._cancelled():  # a cancel wins over the failure of the step it interrupted
                return "cancelled"
            log.exception("run %s failed", self.run_id)
            error = f"{type(exc).__name__}: {exc}"
            await asyncio.to_thread(self.state.finish, "runs", self.run_id, "failed", error=error)
            return "failed"
        finally:
            for task in inflight.values():
                task.cancel()

    def _cancelled(self) -> bool:
        row = self.state.run(self.run_id)
        return row is not None and row["status"] == "cancelled"

    def _append_jsonl(self, metrics: dict[str, Any]) -> None:
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(metrics) + "\n")

    def _rewrite_jsonl(self) -> None:
        """The JSONL mirrors the database: rebuilt on (re)start, so a crash between the commit and the
        append cannot leave a step missing or doubled."""
        self.jsonl.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.jsonl.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(m) + "\n" for m in self.state.run_steps(self.run_id)))
        tmp.replace(self.jsonl)
