"""Environments that misbehave, for the tier's fault tests (named ``tests.env.faulty:<Factory>``
with ``LOOM_ENV_MODULES=["tests.env.faulty"]``): each is a real environment run by a real env worker.
``marker``: a file an environment writes when its step starts, so a test acts mid-step."""

from __future__ import annotations

import os
import time
from pathlib import Path

from loom.contracts.envs import EnvAction, EnvChat, EnvReset, EnvStep, EnvTask


class Base:
    def __init__(self) -> None:
        self.options: dict = {}

    def reset(self, task: EnvTask) -> EnvReset:
        self.options = task.options
        return EnvReset(observation=self.options.get("first"))

    def mark(self, action: EnvAction) -> None:
        if self.options.get("marker"):
            Path(self.options["marker"]).write_text(str(action.turn))

    def close(self) -> None:
        return None


class NeverDone(Base):
    """Answers every turn, never done: the episode ends on its own limits."""

    def step(self, action: EnvAction) -> EnvStep:
        self.mark(action)
        return EnvStep(observation=f"turn {action.turn} seen", reward=0.5)


class Raises(Base):
    def step(self, action: EnvAction) -> EnvStep:
        raise RuntimeError(f"broken at turn {action.turn}")


class RaisesOnReset(Base):
    def reset(self, task: EnvTask) -> EnvReset:
        raise RuntimeError("cannot reset")


class Hangs(Base):
    """Turn 0 answers; from turn ``hang_from`` (default 1) each step sleeps ``sleep_s`` (default 30)."""

    def step(self, action: EnvAction) -> EnvStep:
        self.mark(action)
        if action.turn >= int(self.options.get("hang_from", 1)):
            time.sleep(float(self.options.get("sleep_s", 30)))
        return EnvStep(observation=f"turn {action.turn} seen")


class SlowFirstReset(NeverDone):
    """The first reset (no file ``opener`` yet) writes its worker's pid there and sleeps a minute; the
    others are at once: the open a killed worker left unacknowledged is redelivered and answered."""

    def reset(self, task: EnvTask) -> EnvReset:
        marker = Path(task.options["opener"])
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            time.sleep(60)
        return super().reset(task)


class Drifts(NeverDone):
    """Declares itself replayable but is not: each step's observation names how many episodes this
    worker has opened, so a tree's replay on a fresh episode answers otherwise (env_replay_mismatch)."""

    replayable = True
    opened = 0

    def reset(self, task: EnvTask) -> EnvReset:
        Drifts.opened += 1
        self.episode = Drifts.opened
        return super().reset(task)

    def step(self, action: EnvAction) -> EnvStep:
        return EnvStep(observation=f"turn {action.turn} of episode {self.episode}", reward=0.5)


class ChatReplayable(NeverDone):
    """A chat environment (a system prompt in its reset's ``chat``) that declares itself replayable:
    an agent episode's prompt renders the system prompt; an agent_tree, whose children share the
    request's prompt, cannot replay it."""

    replayable = True

    def reset(self, task: EnvTask) -> EnvReset:
        return EnvReset(chat=EnvChat(system="Answer briefly."))
