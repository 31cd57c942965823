"""The episodes one env worker holds: open, step, close, each answered with a typed status.

An episode's environment lives in this process (docs/environments.md "Stickiness"); its handle is
the key. ``reset`` and ``step`` run on a thread pool beside the task thread, bounded by their
deadline: a step that runs past it is answered ``timeout`` at once (its thread is left to finish,
and the episode's next step waits for it, within its own deadline: an environment is driven by one
thread at a time, ``env_svc/base.py``); one that raises is ``env_error``; an unknown handle (closed,
reaped, or opened by a worker that has died since) is ``env_lost``. Episodes idle past ``idle_s``
(their rollout worker died) are closed at the next open.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

from env_svc.base import Environment, replayable
from env_svc.registry import UnknownEnvironment, factory_of
from loom.contracts.envs import EnvOpened, EnvReset, EnvStep, EnvStepRequest, EnvTask

log = logging.getLogger("loom.env")
T = TypeVar("T")


@dataclass
class Held:
    env: Environment
    name: str
    last: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)  # one step at a time


class Failed(Exception):
    """A reset or step that did not answer: ``status`` (env_error or timeout) and why."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class Episodes:
    def __init__(self, modules: list[str], idle_s: float, open_timeout_s: float, threads: int = 64) -> None:
        self.modules, self.idle_s, self.open_timeout_s = modules, idle_s, open_timeout_s
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="loom-env")

    def __len__(self) -> int:
        return len(self._held)

    def _bounded(self, fn: Callable[[], T], timeout_s: float, what: str, release: threading.Lock | None) -> T:
        """``fn()`` on the pool within ``timeout_s``; ``release`` is unlocked when it returns."""

        def run() -> T:
            try:
                return fn()
            finally:
                if release is not None:
                    release.release()

        fut = self._pool.submit(run)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            if fut.cancel() and release is not None:  # it never started: it must not run stale
                release.release()
            raise Failed("timeout", f"error: environment {what} timed out after {timeout_s:.3g} s") from None
        except Exception as exc:  # the environment's bug is the episode's observation
            detail = f"error: environment {what} raised {type(exc).__name__}: {str(exc)[:200]}"
            raise Failed("env_error", detail) from exc

    def open(self, task: EnvTask, queue: str) -> EnvOpened:
        self.reap()
        try:
            make = factory_of(task.environment, self.modules)
        except UnknownEnvironment as exc:
            return EnvOpened(reset=EnvReset(status="unknown_env", error=str(exc)))
        if task.replay and not replayable(make):
            why = f"environment {task.environment[:128]!r} is not replayable: a tree cannot branch it"
            return EnvOpened(reset=EnvReset(status="not_replayable", error=why))
        made: list[Environment] = []
        try:
            made.append(self._bounded(make, self.open_timeout_s, "construction", None))
            reset = self._bounded(lambda: made[0].reset(task), self.open_timeout_s, "reset", None)
            if not isinstance(reset, EnvReset):
                raise Failed("env_error", f"error: reset returned {type(reset).__name__}, not EnvReset")
        except Failed as exc:
            for env in made:
                self._close_quietly(env)
            return EnvOpened(reset=EnvReset(status=exc.status, error=exc.detail))  # type: ignore[arg-type]
        if reset.status != "ok":
            self._close_quietly(made[0])
            return EnvOpened(reset=reset)
        handle = uuid.uuid4().hex
        with self._lock:
            self._held[handle] = Held(made[0], task.environment)
        return EnvOpened(handle=handle, queue=queue, reset=reset)

    def step(self, req: EnvStepRequest) -> EnvStep:
        held = self._held.get(req.handle)
        if held is None:
            why = "error: environment lost (closed, reaped, or its worker restarted)"
            return EnvStep(observation=why, status="env_lost", error=why)
        held.last = time.monotonic()
        start = time.monotonic()
        if not held.lock.acquire(timeout=req.timeout_s):  # the previous step still runs
            why = f"error: environment step timed out after {req.timeout_s:g} s (its last step still runs)"
            return EnvStep(observation=why, status="timeout", error=why)
        left = max(0.001, req.timeout_s - (time.monotonic() - start))
        try:
            out = self._bounded(lambda: held.env.step(req.action), left, "step", held.lock)
        except Failed as exc:
            return EnvStep(observation=exc.detail, status=exc.status, error=exc.detail)  # type: ignore[arg-type]
        finally:
            held.last = time.monotonic()
        if not isinstance(out, EnvStep):
            why = f"error: step returned {type(out).__name__}, not EnvStep"
            return EnvStep(observation=why, status="env_error", error=why)
        return out

    def end(self, handle: str) -> bool:
        with self._lock:
            held = self._held.pop(handle, None)
        if held is not None:
            self._close_quietly(held.env)
        return held is not None

    def _close_quietly(self, env: Any) -> None:
        """``close`` on the pool, never waited for: a close that hangs holds a pool thread, not a task."""

        def close() -> None:
            try:
                env.close()
            except Exception:
                log.exception("closing an environment failed")

        self._pool.submit(close)

    def reap(self) -> int:
        now = time.monotonic()
        with self._lock:
            idle = [h for h, held in self._held.items() if now - held.last > self.idle_s]
        for handle in idle:
            log.warning("closing episode %s: idle past %g s", handle, self.idle_s)
            self.end(handle)
        return len(idle)

    def close(self) -> None:
        """Every episode closed (the worker's shutdown)."""
        for handle in list(self._held):
            self.end(handle)
        self._pool.shutdown(wait=False)
