"""The RL step's stages over the queues (``CeleryStages``): each a service's Celery task, sent by name.

Orchestration is explicit (not a Celery canvas): the gateway publishes each stage's task BY NAME with
a deterministic idempotency key, awaits its result, and publishes the group's next stage as soon as it
is ready (a group's reward task starts while other groups still generate). Deterministic keys make
every stage restartable: a re-published task whose key already has a result returns that result
(loom.queue.LoomTask), so a restarted gateway re-walks a step without re-generating or re-training.

Every stage is a coroutine: a job or run waiting on its tasks holds futures, not threads. Results are
read for the whole process by one ``loom.results.ResultHub`` thread; publishing (blocking broker I/O)
runs on a small pool of ``publishers`` threads. Fixed costs are shared (``Coalescer``):
the groups whose generation results come back together (one engine batch) are scored by ONE reward
task (``reward.score_groups``), each group's result still stored and read under its own
``<key>.score`` as soon as it is scored, so the keys, the restarts and the cancels work per group
as before (a group alone is still a ``reward.score_group`` task under its key; the reward task's copy
of a group leaves out its log-probs, ``REWARD_DROPS``).

Every task key begins with its job's or run's id and a dot (``scope_of``): ``CeleryStages.cancel(scope)``
marks the scope's published, unfinished tasks as done with a ``SKIPPED`` result, so a worker that
receives one returns at once (LoomTask's idempotency read) instead of generating or scoring for a
cancelled job.

``CeleryStages`` is the product's implementation of the RL step's ``gateway.step.Stages`` (one group
per call); the step itself, and its in-process implementation for benches and tests, are elsewhere
(gateway/step.py, launch/inprocess.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from celery import states
from kombu.exceptions import OperationalError

from gateway.cost import group_budget
from gateway.scheduler import FairGate
from gateway.step import Stages as Stages  # noqa: F401  (what gateway/api.py and manager.py type with)
from gateway.step import gather_all
from loom.contracts import tasks
from loom.contracts.modes import ModeError
from loom.contracts.wire import (
    Group,
    ReflectParams,
    RevisionPlan,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    StepResult,
    TrainBatch,
)
from loom.results import STORE_UNREACHABLE, ResultHub, stored_metas
from loom.timeline import mark

GENERATE = tasks.GENERATE_GROUP.name
SCORE = tasks.SCORE_GROUP.name
SCORE_MANY = tasks.SCORE_GROUPS.name  # several groups in one task, each result under its own key
REFLECT = tasks.REVISE_GROUP.name  # /v1/reflect's whole revision over the queue (not the RL step's)
CUT = tasks.CUT_GROUP.name
ASSEMBLE = tasks.ASSEMBLE_GROUP.name
MATCH = tasks.MATCH_TEXTS.name
MATCH_META = ("numbers", "target")  # what of a group's meta the gold match reads
MATCH_TEXTS = 4096  # texts one reward.match_texts task takes (reward_svc.match.MatchRequest)
TRAIN = tasks.TRAIN_STEP.name
SKIPPED = {"loom_skipped": "cancelled"}  # the result a cancelled job's unfinished tasks are given

log = logging.getLogger("loom.gateway.pipeline")
_UNREACHABLE: tuple[type[BaseException], ...] = (OperationalError, *STORE_UNREACHABLE)  # both come back
R = TypeVar("R")
T = TypeVar("T")
_AWAITED = (states.STARTED, states.SUCCESS, states.RETRY)  # a task in these states is not published again


class Cancelled(RuntimeError):
    pass


class StageError(RuntimeError):
    pass


def scope_of(key: str) -> str:
    """The job or run a task key belongs to (its keys are ``<id>.<...>``)."""
    return key.split(".", 1)[0]


@dataclass
class _Open(Generic[T]):
    done: asyncio.Future[list[BaseException | None]]
    first: float
    last: float
    items: list[T] = field(default_factory=list)
    full: asyncio.Event = field(default_factory=asyncio.Event)


class Coalescer(Generic[T]):
    """Items handed in close together go out in one call: ``await c.add(item)`` joins the open batch
    of its event loop and returns (or raises) that item's outcome once the batch is flushed.
    ``flush(items)`` is a coroutine returning one outcome per item (None, or the exception that item's
    caller gets). A batch is flushed at the loop's next turn after its first item when ``linger`` is
    0 (the callers woken together by one event all join it), else once no item has joined for
    ``linger`` s or ``max_wait`` s after its first, and at once at ``max_items``; one flush at a time
    per loop (a group commit: the items that come while one is flushed go out in the next one, not
    in a second writer contending for the same lock). A caller cancelled while it waits leaves its
    item in the batch (its key is in ``CeleryStages._published``, so a cancel skips it all the same)."""

    def __init__(
        self,
        flush: Callable[[list[T]], Awaitable[list[BaseException | None]]],
        linger: float = 0.0,
        max_wait: float = 0.0,
        max_items: int = 0,
    ) -> None:
        self.flush, self.linger, self.max_wait, self.max_items = (
            flush,
            linger,
            max(max_wait, linger),
            max_items,
        )
        self._open: dict[asyncio.AbstractEventLoop, _Open[T]] = {}
        self._flushing: set[asyncio.Task[None]] = set()  # referenced until done
        self._serial: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}

    async def add(self, item: T) -> None:
        loop = asyncio.get_running_loop()
        batch = self._open.get(loop)
        now = time.monotonic()
        if batch is None:
            batch = self._open[loop] = _Open(loop.create_future(), now, now)
            task = loop.create_task(self._run(loop, batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)
        index = len(batch.items)
        batch.items.append(item)
        batch.last = now
        if self.max_items and len(batch.items) >= self.max_items:
            del self._open[loop]
            batch.full.set()
        outcome = (await asyncio.shield(batch.done))[index]
        if outcome is not None:
            raise outcome

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: _Open[T]) -> None:
        await asyncio.sleep(0)
        while not batch.full.is_set():
            left = min(batch.last + self.linger, batch.first + self.max_wait) - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(batch.full.wait(), left)
            except TimeoutError:
                pass
        serial = self._serial.setdefault(loop, asyncio.Lock())
        try:
            async with serial:  # items still join while the previous flush runs
                if self._open.get(loop) is batch:
                    del self._open[loop]
                items = list(batch.items)
                try:
                    outcomes = await self.flush(items)
                except Exception as exc:
                    outcomes = [exc] * len(items)
        except asyncio.CancelledError:
            batch.done.cancel()
            raise
        finally:
            if not self._flushing - {asyncio.current_task()}:  # idle: no loop kept alive by the map
                self._serial.pop(loop, None)
        batch.done.set_result(outcomes)


# What the reward service never reads of a group: no reward component uses log-probs (checked by
# tests/reward/test_score_groups.py), and they are most of a group's JSON (a float each token against
# a token id), so the reward task's message, its claim and its decoding carry ~3x less without them.
REWARD_DROPS = {"trajectories": {"__all__": {"logprobs"}}}


def for_reward(group: Group) -> dict[str, Any]:
    """``group`` as JSON for its reward task: all of it but what the reward service never reads."""
    return group.model_dump(mode="json", exclude=REWARD_DROPS)


def _fair_cost(request: RolloutRequest) -> float:
    """A generation task's cost to the fair scheduler: its group's worst-case tokens; a request whose
    mode parameters do not parse costs n x max_tokens (the worker refuses it with the reason)."""
    try:
        return float(group_budget(request).tokens)
    except ModeError:
        return float(request.sampling.n * request.sampling.max_tokens)


@dataclass
class CeleryStages:
    """Stages backed by the services' Celery tasks (sent by name: no service package is imported)."""

    app: Any  # celery.Celery
    timeout: float = 3600.0  # how long one task's result is awaited
    poll: float = 0.02
    stop: threading.Event = field(default_factory=threading.Event)
    publish_timeout: float = 300.0  # how long a publish waits for an unreachable broker to come back
    publishers: int = 4  # threads that publish (blocking broker I/O) for every job and run
    # Reward tasks: groups whose generation results come back together (one engine batch) are scored
    # by one ``reward.score_groups`` task, each group's result stored under its own ``<key>.score``
    # as it is scored; a batch waits ``score_linger`` s after its last group joined (at most
    # ``score_max_wait`` s after its first). 1: one ``reward.score_group`` task per group.
    score_batch: int = 16
    score_linger: float = 0.005
    score_max_wait: float = 0.025
    # Generation tasks wait here for a slot of the broker's bounded window, released across API keys
    # by deficit round robin (gateway/scheduler.py); None: each is published as soon as it is asked for.
    fair: FairGate | None = None

    def __post_init__(self) -> None:
        self.hub = ResultHub(self.app, poll=self.poll, name="gateway-results")
        self._pool = ThreadPoolExecutor(self.publishers, thread_name_prefix="gateway-publish")
        self._published: dict[str, set[str]] = {}  # scope -> keys published, result not read yet
        self._scores: Coalescer[tuple[str, Any, Any]] = Coalescer(
            self._publish_scores, self.score_linger, self.score_max_wait, max(1, self.score_batch)
        )

    async def _blocking(self, fn: Callable[..., R], *args: Any) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _publish(self, name: str, key: str, args: tuple[Any, ...]) -> None:
        # A task already started or finished under this key is awaited, not published again.
        mark("publish", key)
        if self.app.AsyncResult(key).state in _AWAITED:
            return
        self.app.send_task(name, args=list(args), task_id=key)
        mark("published", key)

    def _publish_score_task(self, members: list[tuple[str, Any, Any]]) -> None:
        """One reward task for ``members`` (key, group, spec) whose key has no result or running task:
        ``reward.score_group`` under its key for one, ``reward.score_groups`` for several."""
        for key, _, _ in members:
            mark("publish", key)
        known = stored_metas(self.app, [key for key, _, _ in members])
        todo = [m for m in members if known.get(m[0], {}).get("status") not in _AWAITED]
        if len(todo) == 1:
            key, group, spec = todo[0]
            self.app.send_task(SCORE, args=[group, spec], task_id=key)
        elif todo:
            # the batch's own id only names the message: every member's result is under its own key
            self.app.send_task(
                SCORE_MANY, args=[[list(m) for m in todo]], task_id=f"scores-{uuid.uuid4().hex}"
            )
        for key, _, _ in todo:
            mark("published", key)

    async def _publish_scores(self, members: list[tuple[str, Any, Any]]) -> list[BaseException | None]:
        label = members[0][0] if len(members) == 1 else f"{members[0][0]} and {len(members) - 1} more"
        try:
            await self._retrying(SCORE, label, lambda: self._blocking(self._publish_score_task, members))
        except StageError as exc:
            return [exc] * len(members)
        return [None] * len(members)

    async def _retrying(self, name: str, key: str, attempt: Callable[[], Awaitable[Any]]) -> None:
        """``attempt()`` until the broker and result store take it: try again until they are back, the
        last time at or after ``publish_timeout`` s, so a failed publish has always been tried at least
        twice however long one try takes."""
        deadline = time.monotonic() + self.publish_timeout
        wait, tries = 0.25, 0
        while True:
            tries += 1
            try:
                await attempt()
                return
            except _UNREACHABLE as exc:
                what = "broker" if isinstance(exc, OperationalError) else "result store"
                left = deadline - time.monotonic()
                if left <= 0 and tries > 1:
                    raise StageError(
                        f"{what} unreachable for {self.publish_timeout:.0f} s ({tries} tries): {exc}"
                    ) from exc
                pause = min(wait, max(left, 0.0))
                log.warning("publishing %s[%s] failed (%s); again in %.2f s", name, key, exc, pause)
                await self._pause(pause)
                wait = min(2 * wait, 5.0)

    async def _send(self, name: str, key: str, *args: Any) -> str:
        """Publish task ``name`` under ``key``. The broker or the result store may be restarting:
        ``_retrying`` (the task's key makes a duplicate harmless: a task whose key has a result returns
        it, LoomTask)."""

        async def attempt() -> None:
            self._published.setdefault(scope_of(key), set()).add(key)
            await self._blocking(self._publish, name, key, args)

        await self._retrying(name, key, attempt)
        return key

    async def _score(self, key: str, group: Any, spec: Any) -> Any:
        """Score ``group`` (JSON) under ``key``: in a reward task with the groups that joined it
        (``score_batch``), the result read under ``key`` as any task's."""
        self._published.setdefault(scope_of(key), set()).add(key)
        await self._scores.add((key, group, spec))
        return await self._result(key)

    async def _pause(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while True:
            if self.stop.is_set():
                raise Cancelled("stopped")
            left = end - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.1))

    async def _result(self, key: str) -> Any:
        """The result of task ``key`` once it is ready (StageError for a failed task or after
        ``timeout`` s)."""
        try:
            meta = await asyncio.wait_for(self.hub.wait(key), self.timeout)
        except TimeoutError:
            raise StageError(f"task {key} still pending after {self.timeout:.0f} s") from None
        mark("result", key)
        published = self._published.get(scope_of(key))
        if published is not None:
            published.discard(key)
            if not published:
                del self._published[scope_of(key)]
        if meta["status"] != states.SUCCESS:
            err = meta.get("result")
            raise StageError(f"task {key} {meta['status'].lower()}: {type(err).__name__}: {err}")
        return meta["result"]

    async def _call(self, name: str, key: str, *args: Any) -> Any:
        await self._send(name, key, *args)
        return await self._result(key)

    async def generate(self, key: str, request: RolloutRequest) -> Group:
        """``rollout.generate_group`` under ``key``; with ``fair``, published once its key's turn
        gives it a slot (its cost: the group's worst-case tokens, gateway/cost.py), the slot held
        until its result is read."""
        body = request.model_dump(mode="json")
        if self.fair is None:
            return Group.model_validate(await self._call(GENERATE, key, body))
        async with self.fair.slot(key, _fair_cost(request)):
            result = await self._call(GENERATE, key, body)
        return Group.model_validate(result)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        return RewardResult.model_validate(
            await self._score(key, for_reward(group), spec.model_dump(mode="json"))
        )

    async def match(self, key: str, group: Group, texts: list[str]) -> list[bool]:
        """``reward.match_texts`` for ``texts``, in tasks of at most ``MATCH_TEXTS`` texts (what one
        accepts; one task for all but the largest groups)."""
        meta = {k: group.meta[k] for k in MATCH_META if k in group.meta}
        batches = [texts[i : i + MATCH_TEXTS] for i in range(0, len(texts), MATCH_TEXTS)]

        async def one(k: str, batch: list[str]) -> list[bool]:
            body = {"label": group.label, "task": group.task, "meta": meta, "texts": batch}
            verdicts = (await self._call(MATCH, k, body))["verdicts"]
            if len(verdicts) != len(batch):
                raise StageError(f"task {k}: {len(verdicts)} verdicts for {len(batch)} texts")
            return [bool(v["status"] == "ok" and v["correct"]) for v in verdicts]

        keys = [key] if len(batches) == 1 else [f"{key}{j}" for j in range(len(batches))]
        parts = await gather_all(one(k, b) for k, b in zip(keys, batches, strict=True))
        return [v for part in parts for v in part]

    async def cut(
        self, key: str, group: Group, params: ReflectParams, verdicts: list[bool] | None
    ) -> RevisionPlan:
        args = (group.model_dump(mode="json"), params.model_dump(mode="json"), verdicts)
        return RevisionPlan.model_validate(await self._call(CUT, key, *args))

    async def revised(
        self, key: str, group: Group, params: ReflectParams, plan: RevisionPlan, completions: list[Group]
    ) -> Group:
        args = (
            group.model_dump(mode="json"),
            params.model_dump(mode="json"),
            plan.model_dump(mode="json"),
            [g.model_dump(mode="json") for g in completions],
        )
        return Group.model_validate(await self._call(ASSEMBLE, key, *args))

    async def train(self, key: str, batch: TrainBatch) -> StepResult:
        return StepResult.model_validate(await self._call(TRAIN, key, batch.model_dump(mode="json")))

    async def cancel(self, scope: str) -> int:
        """Give every task of ``scope`` published and not read back the ``SKIPPED`` result, so a worker
        that receives it later returns at once; returns how many. A result already stored is kept (the
        result stores never overwrite a SUCCESS), and a task already running finishes unread."""
        keys = sorted(self._published.pop(scope, set()))

        def mark() -> None:
            for key in keys:
                self.app.backend.store_result(key, SKIPPED, states.SUCCESS)

        if keys:
            await self._blocking(mark)
        return len(keys)

    def forget(self, scope: str) -> None:
        self._published.pop(scope, None)
        if self.fair is not None:
            self.fair.forget(scope)

    def close(self) -> None:
        self.hub.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
