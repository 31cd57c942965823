"""prime's ``verifiers`` environments behind Loom's protocol (docs/environments.md, "Environment
libraries").

A verifiers environment (``MultiTurnEnv``, ``ToolEnv``, ``SingleTurnEnv`` and their subclasses) owns
its rollout loop: ``run_rollout`` asks a ``vf.Client`` for each model turn, and between turns runs its
own ``env_response``, stop conditions (``@vf.stop``: ``max_turns_reached``, ``no_tools_called``, the
env's own), ``setup_state``, cleanup and at the end its rubric. Loom drives the policy instead, so the
adapter runs the environment's own ``run_rollout`` unchanged on a background event loop with a client
of its own, ``PolicyClient``, whose every "model call" hands the conversation to Loom and waits for
the policy's turn: ``reset`` starts the rollout and returns when the environment first asks for a
turn; ``step`` answers that ask with the turn (an assistant message: the turn's text, and the tool
call Loom parsed as its ``tool_calls``, arguments JSON-encoded, as ``ToolEnv`` reads them) and returns
when the environment asks again (the messages it appended, its ``env_response``, are the observation)
or when its rollout ends (``done``; any ``final_env_response`` is the observation). The reset also
carries what the environment's first model call would send a chat model beside the question: its
system prompt and its tools as OpenAI function tools (``EnvReset.chat``), which the agent mode renders
through the policy's chat template (docs/environments.md, "The policy's prompt").

Reward: a verifiers rubric scores the whole rollout once, after it ends, so the episode's reward is
the last step's ``EnvStep.reward`` (the rubric's weighted sum, ``state["reward"]``), with its metrics,
its ``stop_condition`` and any error the rollout recorded in ``meta``; earlier steps carry none. A
rollout the environment stopped on its own error (``has_error``) still ends scored, as verifiers
scores it. ``close`` before the end cancels the rollout, which runs the environment's cleanup.

Environments are loaded by verifiers' own ``vf.load_environment(env_id, **env_args)`` (an installed
environment module's ``load_environment``) once per process, in its main thread when the registry is
imported (``load``: building one installs signal handlers), and shared by its episodes, as a
verifiers environment serves many rollouts at once. Which ids are offered, with which arguments, is
the operator's (``LOOM_ENV_VERIFIERS_ENVS``, a JSON object ``{"<name>": {"env_id": ..., "env_args":
{...}}}``; registered as ``verifiers:<name>``); a request supplies only the task and its ``info``.

verifiers' pins (websockets < 17 through openai-agents) cannot share Loom's main venv: it lives in the
side interpreter ``.venv/side-envs`` (deploy/setup.sh), and an env worker that serves these names
runs from it. Where verifiers is not importable no ``verifiers:`` name is registered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import signal
import threading
import time
import uuid
from functools import lru_cache
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from env_svc.adapters.common import json_safe, message_text, plain_messages, render
from env_svc.base import Factory
from loom.contracts.envs import EnvAction, EnvChat, EnvReset, EnvStep, EnvTask
from loom.contracts.wire import Contract

PREFIX = "verifiers:"
MODEL = "loom-policy"  # the model name the environment's state records: Loom's policy


class VerifiersEnvSpec(Contract):
    env_id: str = Field(min_length=1, max_length=256, description="an installed verifiers environment")
    env_args: dict[str, Any] = Field(default_factory=dict, description="its load_environment arguments")


class VerifiersSettings(BaseSettings):
    """The operator's side of verifiers' environments."""

    model_config = SettingsConfigDict(env_prefix="LOOM_ENV_VERIFIERS_", extra="ignore")

    envs: dict[str, VerifiersEnvSpec] = Field(
        default_factory=dict, description="registered name (after 'verifiers:') -> environment and args"
    )
    wait_s: float = Field(
        default=600.0, gt=0, le=86400, description="longest wait for the environment's next ask or end"
    )

    @field_validator("envs")
    @classmethod
    def _names(cls, v: dict[str, VerifiersEnvSpec]) -> dict[str, VerifiersEnvSpec]:
        bad = sorted(n for n in v if not n.isidentifier() or len(n) > 100)
        if bad:
            raise ValueError(f"names must be identifiers (they follow 'verifiers:'): {bad}")
        return v


class VerifiersOptions(Contract):
    """What a task gives the environment beyond its question and label: the dataset row's ``info``."""

    info: dict[str, Any] = Field(default_factory=dict)


@lru_cache(maxsize=1)
def settings() -> VerifiersSettings:
    return VerifiersSettings()


# ------------------------------------------------------------------------------------------------
# the process's event loop and loaded environments


_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loaded: dict[str, Any] = {}
_failed: dict[str, str] = {}  # what went wrong building an environment at start


def event_loop() -> asyncio.AbstractEventLoop:
    """One loop thread per process: every episode's rollout runs on it, as verifiers' environments
    (shared by their episodes) expect one loop."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="verifiers-loop", daemon=True).start()
            _loop = loop
        return _loop


def load(name: str, spec: VerifiersEnvSpec) -> Any:
    """The environment ``name`` names, loaded by verifiers once per process.

    A verifiers ``Environment`` installs SIGINT and SIGTERM handlers when it is built
    (``Environment.__post_init__``), which Python allows only in the main thread, and which would
    replace the host's (a Celery worker's warm shutdown): so environments are built in the main
    thread, by ``registrations`` when the registry is imported, with the process's own handlers put
    back after (verifiers' teardown still runs at exit, through its ``atexit`` hook). An environment
    that failed to build there is refused at reset with the reason."""
    key = f"{name}\n{spec.model_dump_json()}"
    with _lock:
        if key in _failed:
            raise RuntimeError(f"verifiers environment {name!r} failed to load: {_failed[key]}")
        if key not in _loaded:
            import verifiers as vf

            if threading.current_thread() is not threading.main_thread():
                raise RuntimeError(
                    f"verifiers environment {name!r} was not loaded at start (it must be built in the main "
                    "thread: env_svc/adapters/verifiers.py registrations)"
                )
            held = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                _loaded[key] = vf.load_environment(spec.env_id, **spec.env_args)
            finally:
                for sig, handler in held.items():
                    signal.signal(sig, handler)
        return _loaded[key]


def preload(config: VerifiersSettings) -> None:
    """Build every registered environment now (the main thread); a failure is kept for its resets."""
    for name, spec in config.envs.items():
        try:
            load(name, spec)
        except Exception as exc:  # reported by the name's resets, never at import
            with _lock:
                _failed[f"{name}\n{spec.model_dump_json()}"] = f"{type(exc).__name__}: {str(exc)[:300]}"


# ------------------------------------------------------------------------------------------------
# the client whose model is Loom's policy


class Turns:
    """The hand-off between the environment's rollout (on the loop) and the episode's caller: each
    ask of the environment (a conversation) or its end (its output) is an event, each policy turn
    the answer to the pending ask."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.pending: asyncio.Future[Any] | None = None

    async def ask(self, prompt: list[Any], tools: list[Any] | None) -> Any:
        self.pending = self.loop.create_future()
        self.events.put(("ask", (prompt, tools)))
        return await self.pending

    def answer(self, response: Any) -> None:
        pending = self.pending
        if pending is None:
            raise RuntimeError("the environment is not waiting for a turn")
        self.pending = None

        def settle() -> None:
            if not pending.done():  # cancelled with its rollout: nothing waits for it
                pending.set_result(response)

        self.loop.call_soon_threadsafe(settle)

    def next(self, wait_s: float) -> tuple[str, Any]:
        try:
            return self.events.get(timeout=wait_s)
        except queue.Empty:
            raise TimeoutError(f"the verifiers environment neither asked nor ended in {wait_s} s") from None


def policy_client(turns: Turns) -> Any:
    """A ``vf.Client`` whose responses are the turns Loom's policy sends (built here, as verifiers is
    imported only where it is installed)."""
    import verifiers as vf

    class PolicyClient(vf.Client):
        def setup_client(self, config: Any) -> Any:
            raise TypeError("PolicyClient takes its Turns, not a ClientConfig")

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict[str, Any]]:
            return messages, {}

        async def get_native_response(
            self, prompt: Any, model: str, sampling_args: Any, tools: Any = None, **kwargs: Any
        ) -> Any:
            return await self.client.ask(list(prompt), tools)

        async def raise_from_native_response(self, response: Any) -> None:
            return None

        async def from_native_response(self, response: Any) -> Any:
            return response

        async def close(self) -> None:
            return None

    return PolicyClient(turns)


def response_of(action: EnvAction) -> Any:
    """The policy's turn as the ``vf.Response`` a model client returns."""
    import verifiers as vf

    calls = None
    if action.tool_call is not None:
        call = action.tool_call
        args = json.dumps(call.arguments)
        calls = [vf.ToolCall(id=f"call_{action.turn}_{uuid.uuid4().hex[:8]}", name=call.name, arguments=args)]
    message = vf.ResponseMessage(
        content=action.text,
        tool_calls=calls,
        finish_reason="tool_calls" if calls else "stop",
        is_truncated=False,
    )
    return vf.Response(id=f"loom-{uuid.uuid4().hex}", created=int(time.time()), model=MODEL, message=message)


def chat_tool(tool: Any) -> dict[str, Any]:
    """A ``vf.Tool`` as the OpenAI function tool verifiers' own chat-completions client sends a
    model (``OpenAIChatCompletionsClient.to_native_tool``: ``strict`` only where the tool sets it)."""
    function: dict[str, Any] = {
        "name": tool.name,
        "description": tool.description,
        "parameters": json_safe(tool.parameters),
    }
    if getattr(tool, "strict", None) is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def chat_of(prompt: list[Any], tools: list[Any] | None) -> EnvChat | None:
    """The system prompt (the leading system messages of the environment's prompt, joined by a blank
    line) and the tools of its first model call, which the policy's prompt renders; None where it has
    neither."""
    system: list[str] = []
    for message in prompt:
        if plain_messages([message])[0]["role"] != "system":
            break
        system.append(message_text(message))
    schemas = [chat_tool(t) for t in tools or []]
    if not system and not schemas:
        return None
    return EnvChat(system="\n\n".join(system) if system else None, tools=schemas)


# ------------------------------------------------------------------------------------------------
# the episode


class VerifiersEnvironment:
    """One episode of the verifiers environment registered as ``verifiers:<name>``."""

    def __init__(self, name: str, config: VerifiersSettings | None = None) -> None:
        self.config = config or settings()
        if name not in self.config.envs:
            raise ValueError(f"verifiers environment {name!r} is not registered ({sorted(self.config.envs)})")
        self.name = name
        self._turns: Turns | None = None
        self._rollout: concurrent.futures.Future[Any] | None = None
        self._seen = 0  # messages of the conversation the policy has seen (prompt, turns, answers)
        self._prompt_len = 0

    def _input(self, env: Any, task: EnvTask) -> dict[str, Any]:
        options = VerifiersOptions.model_validate(task.options)
        prompt: list[dict[str, str]] = []
        if env.system_prompt:
            prompt.append({"role": "system", "content": env.system_prompt})
        prompt.append({"role": "user", "content": task.question})
        return {"prompt": prompt, "example_id": 0, "answer": task.label or "", "info": options.info}

    def reset(self, task: EnvTask) -> EnvReset:
        env = load(self.name, self.config.envs[self.name])
        rollout_input = self._input(env, task)
        loop = event_loop()
        self._turns = Turns(loop)
        client = policy_client(self._turns)
        self._rollout = asyncio.run_coroutine_threadsafe(
            env.run_rollout(rollout_input, client, MODEL, {}, max_retries=0), loop
        )
        self._rollout.add_done_callback(self._ended)
        self._prompt_len = len(rollout_input["prompt"])
        kind, value = self._turns.next(self.config.wait_s)
        if kind != "ask":
            raise RuntimeError(
                f"the verifiers rollout ended before its first turn: {self._end_reason(value)}"
            )
        prompt, tools = value
        added = prompt[self._prompt_len :]
        self._seen = len(prompt)
        meta = {
            "env": self.name,
            "env_id": self.config.envs[self.name].env_id,
            "messages": plain_messages(prompt),
            "tools": [
                json_safe(t.model_dump()) if hasattr(t, "model_dump") else json_safe(t) for t in tools or []
            ],
        }
        chat = chat_of(prompt[: self._prompt_len], tools)
        return EnvReset(observation=render(added) if added else None, chat=chat, meta=meta)

    def _ended(self, future: concurrent.futures.Future[Any]) -> None:
        if self._turns is None:
            return
        if future.cancelled():
            self._turns.events.put(("error", "cancelled"))
        elif future.exception() is not None:
            self._turns.events.put(("error", future.exception()))
        else:
            self._turns.events.put(("end", future.result()))

    @staticmethod
    def _end_reason(value: Any) -> str:
        if isinstance(value, dict):
            return f"stop_condition={value.get('stop_condition')!r} error={value.get('error')!r}"
        return repr(value)

    def step(self, action: EnvAction) -> EnvStep:
        if self._turns is None:
            raise RuntimeError("step before reset")
        self._turns.answer(response_of(action))
        self._seen += 1  # the policy's turn, now the conversation's last message
        kind, value = self._turns.next(self.config.wait_s)
        if kind == "error":
            raise RuntimeError(f"the verifiers rollout failed: {value!r}")
        if kind == "ask":
            prompt, _ = value
            added = list(prompt[self._seen :])
            self._seen = len(prompt)
            return EnvStep(observation=render(added), meta={"messages": plain_messages(added)})
        return self._final(value)

    def _final(self, output: Any) -> EnvStep:
        completion = list(output.get("completion") or [])
        added = completion[self._seen - self._prompt_len :]
        self._turns = None
        meta = {
            "messages": plain_messages(added),
            "metrics": json_safe(output.get("metrics") or {}),
            "stop_condition": output.get("stop_condition"),
            "error": json_safe(output.get("error")),
            "is_truncated": bool(output.get("is_truncated")),
        }
        reward = output.get("reward")
        return EnvStep(
            observation=render(added), reward=None if reward is None else float(reward), done=True, meta=meta
        )

    def close(self) -> None:
        rollout, self._rollout, self._turns = self._rollout, None, None
        if rollout is not None and not rollout.done():
            rollout.cancel()


def registrations(config: VerifiersSettings | None = None) -> dict[str, Factory]:
    """The registry's ``verifiers:<name>`` names, each a factory of a fresh episode; none where
    verifiers is not installed in this interpreter (the side one, deploy/setup.sh)."""
    from importlib.util import find_spec

    if find_spec("verifiers") is None:
        return {}
    config = config or settings()
    if threading.current_thread() is threading.main_thread():
        preload(config)

    def factory(name: str) -> Factory:
        return lambda: VerifiersEnvironment(name, config)

    return {PREFIX + name: factory(name) for name in config.envs}
