"""Pipelines over the queues: rollout -> reward -> optional reflection -> (adaptive rounds) -> learner.

Orchestration is explicit (not a Celery canvas): the gateway publishes each stage's task BY NAME with
a deterministic idempotency key, polls the result backend, and publishes the next stage as soon as a
group is ready (a group's reward task starts while other groups still generate). Deterministic keys make
every stage restartable: a re-published task whose key already has a result returns that result
(loom.queue.LoomTask), so a restarted gateway re-walks a step without re-generating or re-training.

``Stages`` is the seam: ``CeleryStages`` talks to the real workers; anything with the same methods can
stand in (benchmarks with simulated latencies).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from celery import states
from kombu.exceptions import OperationalError

from gateway.adaptive import AdaptiveConfig, AdaptiveCounters, merge_group, run_rounds, select
from loom.results import STORE_UNREACHABLE, ResultWaiter
from loom.schemas import Group, RewardResult, RewardSpec, RolloutRequest, StepResult, TrainBatch

GENERATE = "rollout.generate_group"
SCORE = "reward.score_group"
REFLECT = "reflect.revise_group"
TRAIN = "learner.train_step"

log = logging.getLogger("loom.gateway.pipeline")
_UNREACHABLE: tuple[type[BaseException], ...] = (OperationalError, *STORE_UNREACHABLE)  # both come back


class Cancelled(RuntimeError):
    pass


class StageError(RuntimeError):
    pass


class Stages(Protocol):
    def generate_and_score(
        self, items: Sequence[tuple[str, RolloutRequest]], spec: RewardSpec, reflect: bool
    ) -> list[tuple[Group, RewardResult]]:
        """Generate, score (and revise) one group per (key, request); results in input order."""
        ...

    def train(self, key: str, batch: TrainBatch) -> StepResult: ...


@dataclass
class CeleryStages:
    """Stages backed by the services' Celery tasks (sent by name: no service package is imported)."""

    app: Any  # celery.Celery
    timeout: float = 3600.0
    poll: float = 0.02
    stop: threading.Event = field(default_factory=threading.Event)

    publish_timeout: float = 300.0  # how long a publish waits for an unreachable broker to come back

    def _send(self, name: str, key: str, *args: Any) -> Any:
        # The broker or the result store may be restarting: try again until it is back (the task's
        # key makes a duplicate harmless: a task whose key has a result returns it, LoomTask).
        deadline = time.monotonic() + self.publish_timeout
        wait = 0.25
        while True:
            try:
                result = self.app.AsyncResult(key)
                # A task already started or finished under this key is awaited, not published again.
                if result.state in ("STARTED", "SUCCESS", "RETRY"):
                    return result
                return self.app.send_task(name, args=list(args), task_id=key)
            except _UNREACHABLE as exc:
                what = "broker" if isinstance(exc, OperationalError) else "result store"
                if time.monotonic() + wait > deadline:
                    raise StageError(f"{what} unreachable for {self.publish_timeout:.0f} s: {exc}") from exc
                log.warning("publishing %s[%s] failed (%s); again in %.2f s", name, key, exc, wait)
                if self.stop.wait(wait):
                    raise Cancelled("stopped") from exc
                wait = min(2 * wait, 5.0)

    def _wait_all(self, pending: dict[int, Any], on_ready: Callable[[int, Any], None]) -> None:
        """Hand each result to ``on_ready`` as soon as it is ready (loom.results.ResultWaiter: one batched
        read per change signal of the result store, not a read per task every ``poll``)."""
        deadline = time.monotonic() + self.timeout
        with ResultWaiter(self.app, poll=self.poll) as waiter:
            while pending:
                if self.stop.is_set():
                    raise Cancelled("stopped")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(f"{len(pending)} tasks still pending after {self.timeout:.0f} s")
                ids = {res.id: i for i, res in pending.items()}
                try:
                    ready = waiter.wait(list(ids), timeout=min(left, 0.25))
                except STORE_UNREACHABLE as exc:  # a restarting result store: read again soon
                    log.warning("result store unreachable (%s); reading again in 1 s", exc)
                    if self.stop.wait(1.0):
                        raise Cancelled("stopped") from exc
                    continue
                for tid, meta in ready.items():
                    i = ids[tid]
                    del pending[i]
                    if meta["status"] != states.SUCCESS:
                        err = meta.get("result")
                        raise StageError(f"task {tid} {meta['status'].lower()}: {type(err).__name__}: {err}")
                    on_ready(i, meta["result"])

    def generate_and_score(
        self, items: Sequence[tuple[str, RolloutRequest]], spec: RewardSpec, reflect: bool
    ) -> list[tuple[Group, RewardResult]]:
        spec_d = spec.model_dump(mode="json")
        groups: dict[int, Group] = {}
        out: dict[int, tuple[Group, RewardResult]] = {}
        gen = {
            i: self._send(GENERATE, key, req.model_dump(mode="json")) for i, (key, req) in enumerate(items)
        }
        score: dict[int, Any] = {}

        def generated(i: int, value: Any) -> None:
            group = Group.model_validate(value)
            groups[i] = group
            score[i] = self._send(SCORE, f"{items[i][0]}.score", group.model_dump(mode="json"), spec_d)

        self._wait_all(gen, generated)

        def scored(i: int, value: Any) -> None:
            out[i] = (groups[i], RewardResult.model_validate(value))

        self._wait_all(score, scored)
        if reflect:
            out = self._reflect(items, out, spec_d)
        return [out[i] for i in range(len(items))]

    def _reflect(
        self,
        items: Sequence[tuple[str, RolloutRequest]],
        scored: dict[int, tuple[Group, RewardResult]],
        spec_d: dict[str, Any],
    ) -> dict[int, tuple[Group, RewardResult]]:
        """Optional stage: reflect.revise_group(group) -> Group with revisions added, then re-score."""
        rev = {
            i: self._send(REFLECT, f"{items[i][0]}.reflect", g.model_dump(mode="json"))
            for i, (g, _) in scored.items()
        }
        revised: dict[int, Group] = {}
        rescore: dict[int, Any] = {}

        def done(i: int, value: Any) -> None:
            revised[i] = Group.model_validate(value)
            rescore[i] = self._send(
                SCORE, f"{items[i][0]}.rescore", revised[i].model_dump(mode="json"), spec_d
            )

        self._wait_all(rev, done)
        out: dict[int, tuple[Group, RewardResult]] = {}
        self._wait_all(rescore, lambda i, v: out.__setitem__(i, (revised[i], RewardResult.model_validate(v))))
        return out

    def train(self, key: str, batch: TrainBatch) -> StepResult:
        res = self._send(TRAIN, key, batch.model_dump(mode="json"))
        box: dict[int, Any] = {}
        self._wait_all({0: res}, lambda i, v: box.__setitem__(i, v))
        return StepResult.model_validate(box[0])


# --------------------------------------------------------------------------------------------------
# One batch of prompts -> scored groups (uniform n, or Reinforce-Ada rounds)


@dataclass
class Collected:
    groups: list[tuple[Group, RewardResult] | None]  # per prompt; None = dropped
    counters: dict[str, float]
    sampled: list[tuple[Group, RewardResult]]  # every group generated (all rounds), for metrics
    seconds: float


def rollout_request(
    base: RolloutRequest, group_id: str, n: int, policy_version: int | None, round_: int = 0
) -> RolloutRequest:
    sampling = base.sampling.model_copy(update={"n": n})
    if sampling.seed is not None:  # a new round must not repeat the previous round's samples
        sampling = sampling.model_copy(update={"seed": sampling.seed + 1000 * round_})
    update: dict[str, Any] = {"group_id": group_id, "sampling": sampling}
    if policy_version is not None:
        update["policy_version"] = policy_version
    return base.model_copy(update=update)


def collect(
    stages: Stages,
    key_prefix: str,
    requests: Sequence[RolloutRequest],
    spec: RewardSpec,
    *,
    adaptive: AdaptiveConfig | None = None,
    policy_version: int | None = None,
    reflect: bool = False,
) -> Collected:
    """Scored groups for ``requests``: one round of ``sampling.n`` each, or adaptive rounds."""
    t0 = time.perf_counter()
    sampled: list[tuple[Group, RewardResult]] = []
    if adaptive is None:
        items = [
            (f"{key_prefix}.p{i}", rollout_request(r, f"{key_prefix}.p{i}", r.sampling.n, policy_version))
            for i, r in enumerate(requests)
        ]
        results = stages.generate_and_score(items, spec, reflect)
        sampled.extend(results)
        counters = AdaptiveCounters(
            prompts=len(requests), samples=sum(len(g.trajectories) for g, _ in results)
        )
        return Collected(list(results), counters.as_dict(), sampled, time.perf_counter() - t0)

    per_prompt: list[list[tuple[Group, RewardResult]]] = [[] for _ in requests]

    def sample(active: list[int], rnd: int) -> list[list[tuple[float, tuple[int, int]]]]:
        items = []
        for i in active:
            gid = f"{key_prefix}.p{i}.r{rnd}"
            items.append(
                (gid, rollout_request(requests[i], gid, adaptive.samples_per_round, policy_version, rnd))
            )
        results = stages.generate_and_score(items, spec, reflect)
        batches = []
        for i, (group, result) in zip(active, results, strict=True):
            per_prompt[i].append((group, result))
            sampled.append((group, result))
            by_id = {r.trajectory_id: r.total for r in result.rewards}
            batches.append([(by_id.get(t.id, 0.0), (i, j)) for j, t in enumerate(group.trajectories)])
        return batches

    pools, counters = run_rounds(len(requests), sample, adaptive)
    chosen = select(pools, adaptive, counters)
    groups: list[tuple[Group, RewardResult] | None] = []
    for i, choice in enumerate(chosen):
        if choice is None:
            groups.append(None)
            continue
        _, kept = choice
        groups.append(
            merge_group(f"{key_prefix}.p{i}", per_prompt[i], kept, pools[i].stats(adaptive.threshold))
        )
    return Collected(groups, counters.as_dict(), sampled, time.perf_counter() - t0)
