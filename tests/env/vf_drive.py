"""The verifiers side of tests/env/test_verifiers_adapter.py: run in the environment-library side
interpreter (.venv/side-envs, deploy/setup.sh), it drives env_svc/adapters/verifiers.py over the
real verifiers environments of tests/env/vf_envs.py and prints each scenario's answers as one JSON
object (name -> list of the reset's and steps' answers, or the error a scenario raised)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

ENVS = {
    "calc": {"env_id": "tests.env.vf_envs", "env_args": {"kind": "tool"}},
    "guess": {"env_id": "tests.env.vf_envs", "env_args": {"kind": "guess"}},
}
os.environ["LOOM_ENV_VERIFIERS_ENVS"] = json.dumps(ENVS)

from env_svc.adapters.verifiers import VerifiersEnvironment, registrations  # noqa: E402
from loom.contracts.envs import EnvAction, EnvTask, ToolCallBody  # noqa: E402


def episode(name: str, question: str, label: str, turns: list[Any], close_early: bool = False) -> list[Any]:
    env = VerifiersEnvironment(name)
    out: list[Any] = [env.reset(EnvTask(environment=f"verifiers:{name}", question=question, label=label))]
    try:
        for i, turn in enumerate(turns):
            text, call = turn if isinstance(turn, tuple) else (turn, None)
            action = EnvAction(text=text, tool_call=ToolCallBody(**call) if call else None, turn=i)
            out.append(env.step(action))
    finally:
        env.close()
    return [a.model_dump(mode="json") for a in out]


def closed_early() -> dict[str, Any]:
    """An episode closed before its end: its rollout is cancelled, and the environment's own cleanup
    handler still runs (verifiers' ``finally``)."""
    from tests.env import vf_envs

    before = len(vf_envs.CLEANED)
    steps = episode("guess", "Guess my number.", "7", ["1"])
    for _ in range(200):  # the cancelled rollout's cleanup runs on the loop thread
        if len(vf_envs.CLEANED) > before:
            break
        time.sleep(0.05)
    return {"steps": steps, "cleaned": vf_envs.CLEANED[before:]}


def off_main_thread() -> dict[str, str]:
    """An environment not built at start cannot be built in a worker thread (verifiers installs
    signal handlers as it builds one): its reset is refused, saying so."""
    import threading

    from env_svc.adapters.verifiers import VerifiersSettings

    config = VerifiersSettings(envs={"late": ENVS["calc"]})
    out: list[dict[str, str]] = []
    task = EnvTask(environment="verifiers:late", question="q")
    env = VerifiersEnvironment("late", config)
    t = threading.Thread(target=lambda: out.append(errors(lambda: env.reset(task))))
    t.start()
    t.join()
    return out[0]


def chat_tools() -> dict[str, Any]:
    """The ToolEnv's reset beside what verifiers' own OpenAI chat-completions client would send a
    chat model as its ``tools`` (``to_native_tool`` of each of the env's ``tool_defs``; it reads
    nothing of its client) and the env's system prompt."""
    import asyncio

    from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

    from env_svc.adapters.verifiers import load, settings

    env = load("calc", settings().envs["calc"])
    native = [asyncio.run(OpenAIChatCompletionsClient.to_native_tool(None, t)) for t in env.tool_defs]  # type: ignore[arg-type]
    reset = episode("calc", "What is 2 + 3?", "5", ["It is 5."])[0]
    return {"reset": reset, "native_tools": json.loads(json.dumps(native)), "system": env.system_prompt}


def errors(fn: Callable[[], Any]) -> dict[str, str]:
    try:
        fn()
    except Exception as exc:  # the scenario is the raise
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": ""}


SCENARIOS: dict[str, Callable[[], Any]] = {
    "registered": lambda: sorted(registrations()),
    "tool_right": lambda: episode(
        "calc",
        "What is 2 + 3?",
        "5",
        [("call add", {"name": "add", "arguments": {"a": 2, "b": 3}}), "The answer is 5."],
    ),
    "tool_wrong": lambda: episode("calc", "What is 2 + 3?", "5", ["It is 6."]),
    "tool_unknown": lambda: episode(
        "calc", "What is 2 + 3?", "5", [("call", {"name": "nope", "arguments": {}}), "5"]
    ),
    "guess_right": lambda: episode("guess", "Guess my number.", "7", ["3", "I say 9", "7"]),
    "guess_out_of_turns": lambda: episode("guess", "Guess my number.", "7", ["1", "2", "3", "4", "5"]),
    "closed_early": closed_early,
    "chat_tools": chat_tools,
    "after_close": lambda: episode("guess", "Guess my number.", "4", ["4"]),
    "off_main_thread": off_main_thread,
    "unknown_name": lambda: errors(lambda: VerifiersEnvironment("nope")),
    "bad_options": lambda: errors(
        lambda: VerifiersEnvironment("calc").reset(
            EnvTask(environment="verifiers:calc", question="q", options={"info": 3})
        )
    ),
}

if __name__ == "__main__":
    results: dict[str, Any] = {}
    for key, run in SCENARIOS.items():
        try:
            results[key] = run()
        except Exception as exc:
            results[key] = {"scenario_error": f"{type(exc).__name__}: {exc}"}
    sys.stdout.write("\nRESULTS " + json.dumps(results) + "\n")
