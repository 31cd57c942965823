"""The protocol every environment follows, built-in or adapted from an environment library.

One instance per episode, driven by one thread at a time: ``reset`` with the task, ``step`` per policy
turn until it answers ``done`` (or the episode ends on its own limits), ``close`` always, also after
an error. ``reset`` and ``step`` may raise; the tier turns a raise into ``env_error`` and a step past
its deadline into ``timeout`` (``loom/contracts/envs.py``), so an environment needs no defensive code
of its own.
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
