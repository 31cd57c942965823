"""The protocol every environment follows, built-in or adapted from an environment library.

One instance per episode, driven by one thread at a time: ``reset`` with the task, ``step`` per policy
turn until it answers ``done`` (or the episode ends on its own limits), ``close`` always, also after
an error. ``reset`` and ``step`` may raise; the tier turns a raise into ``env_error`` and a step past
its deadline into ``timeout`` (``loom/contracts/envs.py``), so an environment needs no defensive code
of its own.

**Replayable**: a factory with ``replayable = True`` (a class attribute) promises that a fresh
instance reset with the same task (the same seed) and sent the same actions answers the same
observations, rewards and ``done``; agent_tree branches such an environment's episodes by reopening it
and replaying the parent's actions (docs/environments.md "Trees by replay"), every replayed answer
checked against the parent's. Without it (the default) a tree's open is refused, ``not_replayable``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from loom.contracts.envs import EnvAction, EnvReset, EnvStep, EnvTask


class Environment(Protocol):
    def reset(self, task: EnvTask) -> EnvReset: ...

    def step(self, action: EnvAction) -> EnvStep: ...

    def close(self) -> None: ...


# the registry: name -> factory (no arguments; the task comes with reset)
Factory = Callable[[], Environment]


def replayable(factory: object) -> bool:
    """Whether ``factory`` declares its environments replayable (``replayable = True``)."""
    return getattr(factory, "replayable", False) is True
