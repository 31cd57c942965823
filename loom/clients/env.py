"""Client of the env tier (docs/environments.md): what an agent episode's rollout worker calls.

``EnvSession.open`` publishes ``env.open`` on the shared ``env`` queue and awaits its answer, which
names the one worker holding the episode; ``step`` and ``close`` go to that worker's own queue. Every
wait is bounded and none blocks the event loop (publishing runs on the loop's executor; the results
are awaited through one ``loom.results.ResultHub`` thread per process, so a rollout task's many
concurrent episodes cost a future each): a step is awaited for its deadline plus
``Settings.env_grace_s``, an open for ``env_open_timeout_s`` plus the grace. A wait that runs out is
``env_lost`` (the worker died, or none is running), a task that failed is ``env_error``: typed
answers, never an exception, so one lost environment ends its episode and nothing else.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from typing import Any

from celery import states

from loom.contracts.envs import (
    MAX_ACTION_CHARS,
    EnvAction,
    EnvOpened,
    EnvReset,
    EnvStep,
    EnvStepRequest,
    EnvTask,
    ToolCallBody,
)
from loom.contracts.settings import Settings, get_settings
from loom.contracts.tasks import ENV_CLOSE, ENV_OPEN, ENV_STEP, TaskDef
from loom.queue import make_celery, send
from loom.results import ResultHub
from loom.runtime import Shared


class EnvClient:
    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or get_settings()
        self.app = make_celery("env", self.settings)
        self.hub = ResultHub(self.app, name="env-results")

    async def publish(self, task: TaskDef, *args: Any, key: str, to: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, functools.partial(send, self.app, task, *args, key=key, to=to))

    async def call(self, task: TaskDef, *args: Any, wait_s: float, to: str | None = None) -> tuple[str, Any]:
        """``(status, value)``: ``ok`` and the task's result, ``lost`` (no answer within ``wait_s``, or
        it could not be published) or ``failed`` (the task raised) and why."""
        key = uuid.uuid4().hex
        try:
            await self.publish(task, *args, key=key, to=to)
        except Exception as exc:  # the broker is down: this environment is unreachable
            return "lost", f"could not publish {task.name}: {type(exc).__name__}: {str(exc)[:200]}"
        try:
            meta = await asyncio.wait_for(self.hub.wait(key), wait_s)
        except TimeoutError:
            return "lost", f"no env worker answered {task.name} within {wait_s:g} s"
        if meta.get("status") != states.SUCCESS:
            return "failed", f"{task.name} failed: {str(meta.get('result'))[:300]}"
        return "ok", meta.get("result")

    def close(self) -> None:
        self.hub.close()
        self.app.close()


_client: Shared[EnvClient] = Shared(EnvClient)
get_env_client = _client.get  # the process's one client, made on first use
close_env_client = _client.close  # a test's reset (new settings)


class EnvSession:
    """One episode's environment, open on one env worker (``opened``): ``step`` each turn, ``close``."""

    def __init__(self, client: EnvClient, opened: EnvOpened) -> None:
        self.client, self.opened = client, opened

    @property
    def reset(self) -> EnvReset:
        return self.opened.reset

    @classmethod
    async def open(cls, client: EnvClient, task: EnvTask) -> EnvSession:
        s = client.settings
        status, value = await client.call(ENV_OPEN, task, wait_s=s.env_open_timeout_s + s.env_grace_s)
        if status == "ok":
            return cls(client, EnvOpened.model_validate(value))
        reset = EnvReset(status="env_lost" if status == "lost" else "env_error", error=str(value))
        return cls(client, EnvOpened(reset=reset))

    async def step(self, text: str, call: Any, turn: int, timeout_s: float) -> EnvStep:
        """``call``: the turn's parsed tool call (``name``, ``arguments``) or None."""
        body = None if call is None else ToolCallBody(name=call.name[:128], arguments=call.arguments)
        action = EnvAction(text=text[-MAX_ACTION_CHARS:], tool_call=body, turn=turn)
        request = EnvStepRequest(handle=self.opened.handle, action=action, timeout_s=timeout_s)
        wait_s = timeout_s + self.client.settings.env_grace_s
        status, value = await self.client.call(ENV_STEP, request, wait_s=wait_s, to=self.opened.queue)
        if status == "ok":
            return EnvStep.model_validate(value)
        lost = status == "lost"
        why = f"error: environment {'lost' if lost else 'failed'}: {value}"
        return EnvStep(observation=why, status="env_lost" if lost else "env_error", error=str(value))

    async def close(self) -> None:
        """Tell the worker to close it, not waiting: a worker that is gone has nothing left to close."""
        if not self.opened.handle:
            return
        try:
            opened = self.opened
            await self.client.publish(ENV_CLOSE, opened.handle, key=uuid.uuid4().hex, to=opened.queue)
        except Exception:  # its worker reaps it when idle (Settings.env_idle_s)
            pass
