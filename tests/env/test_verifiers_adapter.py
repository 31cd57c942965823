"""env_svc/adapters/verifiers.py over prime's real verifiers classes (docs/environments.md,
"Environment libraries"): a ``ToolEnv`` with a Python function as its tool and a ``MultiTurnEnv``
subclass with its own ``env_response``, ``setup_state``, stop condition, cleanup and rubric
(tests/env/vf_envs.py), each run by verifiers' own ``run_rollout`` with the adapter's policy client.

verifiers 0.2.1 cannot share the main venv (openai-agents' websockets<17), so its side runs in the
side interpreter deploy/setup.sh makes, ``<main venv>/side-envs``: tests/env/vf_drive.py drives the
scenarios there, once for this module, and prints their answers; each test here checks one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.env.library_tier import env_worker, episode

SIDE_PYTHON = Path(sys.prefix) / "side-envs" / "bin" / "python"
REPO = Path(__file__).resolve().parents[2]

if not SIDE_PYTHON.is_file():
    pytest.skip(
        f"no environment-library side interpreter at {SIDE_PYTHON} (verifiers 0.2.1, whose websockets<17 "
        "cannot share this venv): `bash deploy/setup.sh` makes it",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def side() -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(SIDE_PYTHON), str(REPO / "tests" / "env" / "vf_drive.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    results: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULTS "))
    for name, result in results.items():
        assert not (isinstance(result, dict) and "scenario_error" in result), (name, result)
    return results


def test_registered_names(side: dict[str, Any]) -> None:
    assert side["registered"] == ["verifiers:calc", "verifiers:guess"]


def test_tool_env_runs_the_parsed_call_and_scores_with_its_rubric(side: dict[str, Any]) -> None:
    reset, call, answer = side["tool_right"]
    assert reset["observation"] is None and reset["status"] == "ok"
    (tool,) = reset["meta"]["tools"]  # ToolEnv's own schema of the Python function
    assert tool["name"] == "add" and tool["parameters"]["required"] == ["a", "b"]
    # the call Loom parsed became the assistant message's tool_calls; ToolEnv ran add(2, 3)
    assert call["observation"] == "5" and call["done"] is False and call["reward"] is None
    assert call["meta"]["messages"][0]["role"] == "tool"
    # a turn without a call: ToolEnv's no_tools_called stop, then the rubric's reward at the end
    assert answer["done"] is True and answer["reward"] == 1.0
    assert answer["meta"]["stop_condition"] == "no_tools_called"
    assert answer["meta"]["metrics"]["add_calls"] == 1.0 and answer["meta"]["metrics"]["num_turns"] == 2.0


def test_tool_env_wrong_answer_scores_zero(side: dict[str, Any]) -> None:
    reset, answer = side["tool_wrong"]
    assert answer["done"] is True and answer["reward"] == 0.0
    assert answer["meta"]["metrics"]["total_tool_calls"] == 0.0


def test_tool_env_unknown_tool_is_its_error_message(side: dict[str, Any]) -> None:
    _, call, answer = side["tool_unknown"]
    # ToolEnv's own error_formatter answers a call to a tool it lacks (KeyError 'nope')
    assert call["observation"] == "'nope'" and call["done"] is False and call["status"] == "ok"
    assert answer["done"] is True


def test_multiturn_env_responses_stop_condition_and_reward(side: dict[str, Any]) -> None:
    reset, *steps = side["guess_right"]
    assert [m["role"] for m in reset["meta"]["messages"]] == ["system", "user"]  # the env's system prompt
    assert [s["observation"] for s in steps[:2]] == ["3 is wrong: go higher.", "9 is wrong: go lower."]
    assert [s["reward"] for s in steps[:2]] == [None, None] and not any(s["done"] for s in steps[:2])
    assert steps[2]["done"] is True and steps[2]["meta"]["stop_condition"] == "guessed"
    assert steps[2]["reward"] == pytest.approx(1 / 3)  # the rubric's 1/turns


def test_multiturn_env_max_turns(side: dict[str, Any]) -> None:
    _, *steps = side["guess_out_of_turns"]
    assert len(steps) == 5 and [s["done"] for s in steps] == [False] * 4 + [True]
    assert steps[-1]["meta"]["stop_condition"] == "max_turns_reached" and steps[-1]["reward"] == 0.0


def test_close_before_the_end_cancels_and_cleans_up(side: dict[str, Any]) -> None:
    early = side["closed_early"]
    assert [s.get("done") for s in early["steps"][1:]] == [False]
    assert early["cleaned"] == ["None"]  # the env's own cleanup ran for the cancelled rollout
    # the shared loop and the loaded environment go on serving episodes
    assert side["after_close"][1]["reward"] == 1.0


def test_an_environment_not_built_at_start_is_refused_off_the_main_thread(side: dict[str, Any]) -> None:
    assert side["off_main_thread"]["raised"] == "RuntimeError"
    assert "not loaded at start" in side["off_main_thread"]["message"]


def test_unknown_name_and_bad_options_are_refused(side: dict[str, Any]) -> None:
    assert side["unknown_name"]["raised"] == "ValueError" and "'nope'" in side["unknown_name"]["message"]
    assert side["bad_options"]["raised"] == "ValidationError" and "info" in side["bad_options"]["message"]


CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_agent_episodes_in_verifiers_envs_on_a_side_env_worker(tmp_path: Path, tiny_engine: Any) -> None:
    """Loom's agent mode, the real torch engine, a ``loom worker env`` started from the side
    interpreter: the ToolEnv runs the call Loom parsed from the turn, its tool message is the
    observation the policy reads, the rubric's reward the last turn's; then the MultiTurnEnv's own
    responses."""
    envs = {
        "calc": {"env_id": "tests.env.vf_envs", "env_args": {"kind": "tool"}},
        "guess": {"env_id": "tests.env.vf_envs", "env_args": {"kind": "guess"}},
    }
    with env_worker(tmp_path, python=str(SIDE_PYTHON), LOOM_ENV_VERIFIERS_ENVS=json.dumps(envs)):
        tool = episode(
            tiny_engine, "Q: what is 2 + 3?\n", "5", [CALL, "The answer is 5."], environment="verifiers:calc"
        )
        guess = episode(tiny_engine, "Guess my number.\n", "7", ["3", "7"], environment="verifiers:guess")
    assert tool.meta["stop"] == "env_done" and tool.meta["tool_calls"] == 1
    assert tool.meta["turn_rewards"] == [None, 1.0]
    assert [s.kind for s in tool.segments] == ["turn", "observation", "turn"]
    assert tool.segments[0].meta["tool_call"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    assert [s.meta.get("reward") for s in tool.segments if s.kind == "turn"] == [None, 1.0]
    obs = tool.segments[1]
    observed = tiny_engine.tokenizer.decode(tool.completion_ids[obs.start : obs.end])
    assert "<tool_response>\n5\n</tool_response>" in observed
    assert guess.meta["stop"] == "env_done" and guess.meta["turn_rewards"] == [None, 0.5]
    obs = guess.segments[1]
    assert "3 is wrong: go higher." in tiny_engine.tokenizer.decode(guess.completion_ids[obs.start : obs.end])
