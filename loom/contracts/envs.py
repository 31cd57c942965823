"""The environment tier's wire models (docs/environments.md): an agent episode's environment.

An environment is opened with the episode's task (``EnvTask``: the registry name, the prompt's
question and label, the environment's own options), answers each of the policy's turns
(``EnvAction``: the turn's text and the tool call Loom parsed from it, if any) with an ``EnvStep``
(the observation the policy reads next, a per-turn reward where the environment gives one, ``done``)
and is closed when the episode ends. Every failure is a typed status, never an exception across the
boundary: ``env_error`` (the environment raised), ``timeout`` (a step ran past its deadline),
``env_lost`` (the worker holding the episode's state died or forgot it), ``unknown_env``,
``not_replayable`` (opened for a tree's replay, an environment that does not declare it). The
implementations and the protocol they follow are ``env_svc/base.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

# the built-in names and their check live beside the agent's tools; re-exported for the tier
from loom.contracts.modes import ENVIRONMENTS as ENVIRONMENTS
from loom.contracts.modes import LIBRARIES as LIBRARIES
from loom.contracts.modes import known_environment as known_environment
from loom.contracts.wire import Contract

EnvStatus = Literal["ok", "env_error", "timeout", "env_lost", "unknown_env", "not_replayable"]

MAX_ACTION_CHARS = 200_000
MAX_OBSERVATION_CHARS = 1_000_000
MAX_TOOLS = 256


class EnvTask(Contract):
    """What an episode's environment is opened with."""

    environment: str = Field(min_length=1, max_length=128, description="a name in the env registry")
    question: str = Field(default="", max_length=MAX_ACTION_CHARS)
    label: str | None = Field(default=None, max_length=MAX_ACTION_CHARS)
    options: dict[str, Any] = Field(default_factory=dict, description="the environment's own options")
    seed: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    replay: bool = Field(
        default=False,
        description="opened to be replayed (an agent_tree's episode): an environment whose factory is not "
        "replayable is refused (not_replayable)",
    )


class ToolCallBody(Contract):
    name: str = Field(max_length=128)
    arguments: dict[str, Any] = Field(default_factory=dict)


class EnvAction(Contract):
    """One policy turn as the environment sees it."""

    text: str = Field(max_length=MAX_ACTION_CHARS)
    tool_call: ToolCallBody | None = None
    turn: int = Field(ge=0)


class EnvChat(Contract):
    """What a chat environment sends a chat model beside the task's question: its system prompt and
    its tools' schemas, each an OpenAI chat-completions function tool (``{"type": "function",
    "function": {"name", "description", "parameters"}}``). The agent mode renders them with the
    question through the policy's chat template (docs/environments.md, "The policy's prompt")."""

    system: str | None = Field(default=None, max_length=MAX_OBSERVATION_CHARS)
    tools: list[dict[str, Any]] = Field(default_factory=list, max_length=MAX_TOOLS)


class EnvReset(Contract):
    """An opened environment: an optional first observation (appended before the first turn) and,
    for a chat environment, the system prompt and tools its prompt carries (``chat``)."""

    observation: str | None = Field(default=None, max_length=MAX_OBSERVATION_CHARS)
    chat: EnvChat | None = Field(
        default=None, description="a chat environment's system prompt and tool schemas; None: none"
    )
    status: EnvStatus = "ok"
    error: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class EnvStep(Contract):
    """The environment's answer to one turn."""

    observation: str = Field(default="", max_length=MAX_OBSERVATION_CHARS)
    reward: float | None = Field(default=None, description="this turn's reward, where the env gives one")
    done: bool = False
    status: EnvStatus = "ok"
    error: str | None = None
    meta: dict[str, Any] = Field(default_factory=dict)


class EnvOpened(Contract):
    """``env.open``'s answer: the episode's handle and the queue of the one worker that holds it (its
    steps and its close go there: an episode's state lives in one process)."""

    handle: str = Field(default="", max_length=128, description="empty: nothing was opened")
    queue: str = Field(default="", max_length=256)
    reset: EnvReset = Field(default_factory=EnvReset)


class EnvStepRequest(Contract):
    """``env.step``: one turn for the episode ``handle``, answered within ``timeout_s``."""

    handle: str = Field(min_length=1, max_length=128)
    action: EnvAction
    timeout_s: float = Field(gt=0, le=3600)
