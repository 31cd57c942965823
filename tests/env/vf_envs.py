"""Two verifiers environments written against the library's own classes, as an environment package
would be (a module with ``load_environment``, loaded by ``vf.load_environment``): a ``ToolEnv``
with one Python function as its tool, and a ``MultiTurnEnv`` number-guessing game with its own
``env_response``, ``setup_state``, stop condition and rubric. tests/env/test_verifiers_adapter.py
drives them through env_svc/adapters/verifiers.py (docs/environments.md, "Environment libraries").
Imported only in the interpreter that has verifiers (.venv/side-envs)."""

from __future__ import annotations

import re

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def _last_text(completion: vf.Messages) -> str:
    for message in reversed(completion):
        if message.role == "assistant" and isinstance(message.content, str):
            return message.content
    return ""


async def answered(completion: vf.Messages, answer: str) -> float:
    """1 when the last assistant message says the answer."""
    return 1.0 if answer and answer in _last_text(completion) else 0.0


def tool_env() -> vf.Environment:
    dataset = Dataset.from_list([{"question": "What is 2 + 3?", "answer": "5"}])
    return vf.ToolEnv(
        tools=[add],
        max_turns=4,
        dataset=dataset,
        rubric=vf.Rubric(funcs=[answered]),
        system_prompt="Use the add tool for sums.",
    )


CLEANED: list[str] = []  # each finished rollout's stop condition, in order (its cleanup handler's)


class GuessEnv(vf.MultiTurnEnv):
    """Guess the hidden number (the task's answer): each wrong guess is told higher or lower."""

    @vf.cleanup
    async def note_cleanup(self, state: vf.State) -> None:
        CLEANED.append(str(state.get("stop_condition")))

    async def setup_state(self, state: vf.State) -> vf.State:
        state["guesses"] = []
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess = state["guesses"][-1] if state["guesses"] else None
        if guess is None:
            return [vf.UserMessage(content="Answer with a number.")]
        hint = "higher" if guess < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=f"{guess} is wrong: go {hint}.")]

    async def add_trajectory_step(self, state: vf.State, trajectory_step) -> None:
        await super().add_trajectory_step(state, trajectory_step)
        found = re.findall(r"-?\d+", _last_text(trajectory_step["completion"]))
        state["guesses"].append(int(found[-1]) if found else None)

    @vf.stop
    async def guessed(self, state: vf.State) -> bool:
        guesses = state.get("guesses") or []
        return bool(guesses) and guesses[-1] == int(state["answer"])


async def solved_in(state: vf.State) -> float:
    """1/turns when the last guess was right, else 0."""
    guesses = state.get("guesses") or []
    if guesses and guesses[-1] == int(state["answer"]):
        return 1.0 / len(guesses)
    return 0.0


def guess_env() -> vf.Environment:
    dataset = Dataset.from_list([{"question": "Guess my number between 1 and 10.", "answer": "7"}])
    rubric = vf.Rubric(funcs=[solved_in])
    return GuessEnv(max_turns=5, dataset=dataset, rubric=rubric, system_prompt="You play a guessing game.")


def load_environment(kind: str = "tool") -> vf.Environment:
    return {"tool": tool_env, "guess": guess_env}[kind]()
