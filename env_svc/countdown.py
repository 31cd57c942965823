"""``countdown``: the policy proposes Countdown answers and each is checked exactly (docs/environments.md).

A turn's answer is its ``countdown_check`` tool call's ``expression`` if it made one, else its last
``\\boxed{...}``; it is checked with ``loom.exact.check_countdown`` (each number used exactly once, the
value exactly the target, on fractions: no float tolerance to game). Each turn is rewarded 1 or 0; the
episode is done when an answer is correct or after ``max_tries`` turns. The problem is the task's
``options`` (``numbers``, ``target``) or, failing them, its label (``{"numbers": [...], "target": n}``
as JSON, the reward service's countdown label).
"""

from __future__ import annotations

from pydantic import Field

from loom.answers import last_boxed
from loom.contracts.envs import EnvAction, EnvReset, EnvStep, EnvTask
from loom.contracts.wire import Contract
from loom.exact import check_countdown, parse_countdown

CHECK_TOOL = "countdown_check"


class CountdownOptions(Contract):
    numbers: list[int] | None = Field(default=None, max_length=16)
    target: int | None = None
    max_tries: int = Field(default=3, ge=1, le=64, description="turns before the episode is done")


class CountdownEnv:
    # a pure function of the task and the actions so far (the tries counted): a tree replays it
    replayable = True

    def __init__(self) -> None:
        self.numbers: list[int] = []
        self.target = 0
        self.max_tries = CountdownOptions().max_tries
        self.tries = 0

    def reset(self, task: EnvTask) -> EnvReset:
        opts = CountdownOptions.model_validate(task.options)
        spec = {"numbers": opts.numbers, "target": opts.target} if opts.numbers is not None else task.label
        gold = parse_countdown(spec or "")
        if gold is None:
            raise ValueError("countdown needs numbers and target: in env_options or the label")
        (self.numbers, self.target), self.max_tries, self.tries = gold, opts.max_tries, 0
        return EnvReset(meta={"numbers": self.numbers, "target": self.target, "max_tries": self.max_tries})

    @staticmethod
    def answer(action: EnvAction) -> str | None:
        call = action.tool_call
        if call is not None and call.name == CHECK_TOOL:
            value = call.arguments.get("expression", call.arguments.get("input"))
            return str(value) if isinstance(value, str | int) else None
        return last_boxed(action.text)

    def step(self, action: EnvAction) -> EnvStep:
        self.tries += 1
        answer = self.answer(action)
        correct = answer is not None and check_countdown(answer, self.numbers, self.target)
        done = correct or self.tries >= self.max_tries
        if answer is None:
            text = f"no answer: write \\boxed{{expression}} or call {CHECK_TOOL}"
        else:
            text = "correct" if correct else "incorrect"
        text += "" if correct else f" (try {self.tries} of {self.max_tries})"
        return EnvStep(observation=text, reward=1.0 if correct else 0.0, done=done, meta={"answer": answer})

    def close(self) -> None:
        return None
