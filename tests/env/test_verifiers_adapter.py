"""env_svc/adapters/verifiers.py over prime's real verifiers classes (docs/environments.md,
"Environment libraries"): a ``ToolEnv`` with a Python function as its tool and a ``MultiTurnEnv``
subclass with its own ``env_response``, ``setup_state``, stop condition, cleanup and rubric
(tests/env/vf_envs.py), each run by verifiers' own ``run_rollout`` with the adapter's policy client.

verifiers 0.2.1 cannot share the main venv (openai-agents' websockets<17), so its side runs in the
side interpreter deploy/setup.sh makes, ``<main venv>/side-envs``: tests/env/vf_drive.py drives the
scenarios there, once for this module, and prints their answers; each test here checks one.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout_svc.engines.torch import teacher_forced_logprobs
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


def test_the_reset_carries_the_system_prompt_and_the_tools_a_chat_client_would_send(
    side: dict[str, Any],
) -> None:
    chat = side["chat_tools"]
    # the schemas as verifiers' own OpenAI chat-completions client writes them, strict and all
    assert chat["reset"]["chat"] == {"system": chat["system"], "tools": chat["native_tools"]}
    assert chat["native_tools"][0]["function"]["name"] == "add"
    assert side["guess_right"][0]["chat"] == {"system": "You play a guessing game.", "tools": []}


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


def test_agent_episodes_in_verifiers_envs_on_a_side_env_worker(
    tmp_path: Path, tiny_engine: Any, side: dict[str, Any]
) -> None:
    """Loom's agent mode, the real torch engine, a ``loom worker env`` started from the side
    interpreter: the ToolEnv runs the call Loom parsed from the turn, its tool message is the
    observation the policy reads, the rubric's reward the last turn's; then the MultiTurnEnv's own
    responses. The tiny model's template ignores ``tools=``: the policy's prompt is the documented
    fallback, the env's system prompt and its tools' schemas in the system message, then the
    request's prompt (rollout_svc/modes/env_chat.py)."""
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
    tools = side["chat_tools"]["native_tools"]
    system = "Use the add tool for sums.\n\n# Tools\n<tools>\n" + json.dumps(tools[0]) + "\n</tools>"
    tok = tiny_engine.tokenizer
    assert tool.prompt_ids == tok.encode(system + "\nQ: what is 2 + 3?\n", add_special_tokens=False)
    assert tool.meta["env_prompt"] == "fallback"
    assert_conditioned_on_its_prompt(tiny_engine.model, tool)
    assert guess.meta["env_prompt"] == "template"  # a system prompt alone: the template's system line
    guess_prompt = "You play a guessing game.\nGuess my number.\n"
    assert guess.prompt_ids == tok.encode(guess_prompt, add_special_tokens=False)
    assert guess.meta["stop"] == "env_done" and guess.meta["turn_rewards"] == [None, 0.5]
    obs = guess.segments[1]
    assert "3 is wrong: go higher." in tiny_engine.tokenizer.decode(guess.completion_ids[obs.start : obs.end])


def assert_conditioned_on_its_prompt(model: Any, t: Any) -> None:
    """The policy's tokens carry the model's log-probs given the trajectory's own prompt_ids (the ids
    it was conditioned on); observation tokens 0.0 with loss mask 0."""
    want = teacher_forced_logprobs(model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
    assert t.logprobs is not None and len(t.logprobs) == len(t.loss_mask) == len(t.completion_ids)
    sampled = [i for i, m in enumerate(t.loss_mask) if m]
    assert sampled and [t.logprobs[i] for i in sampled] == pytest.approx([want[i] for i in sampled], abs=1e-4)
    assert all(t.logprobs[i] == 0.0 for i, m in enumerate(t.loss_mask) if not m)


def test_a_tools_aware_template_renders_the_envs_system_prompt_and_tools(
    tmp_path: Path, side: dict[str, Any]
) -> None:
    """A random-weight Qwen3 with Qwen3's own chat template, sampled by the real torch engine through
    the rollout path (the request's prompt text, encoded, then the agent mode): the ToolEnv's system
    prompt and schemas reach the policy as ``apply_chat_template`` renders them with ``tools=``, the
    request's prompt the user turn; the trajectory's prompt_ids are the ids the engine sampled from."""
    import torch
    from transformers import Qwen3ForCausalLM

    from loom.contracts.settings import Settings
    from loom.contracts.wire import RolloutRequest, SamplingParams
    from loom.runtime import configure_process
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.rollout import generate_group
    from tests.qwen3_style import qwen3_chat_template, qwen3_style_tokenizer, tiny_qwen3_config

    configure_process()
    tok = qwen3_style_tokenizer()
    tok.chat_template = qwen3_chat_template()
    tok.model_max_length = 4096
    torch.manual_seed(0)
    cfg = tiny_qwen3_config(tok, max_position_embeddings=4096)
    path = tmp_path / "qwen3"
    Qwen3ForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    model = Qwen3ForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()

    request = RolloutRequest(
        mode="agent",
        prompt="What is 2 + 3?",
        label="5",
        sampling=SamplingParams(max_tokens=8, temperature=0.0, n=1, seed=1),
        mode_params={"environment": "verifiers:calc", "tool_timeout_s": 30.0},
    )
    envs = {"calc": {"env_id": "tests.env.vf_envs", "env_args": {"kind": "tool"}}}
    engine = TorchEngine(path, cache_entries=8)
    try:
        with env_worker(tmp_path, python=str(SIDE_PYTHON), LOOM_ENV_VERIFIERS_ENVS=json.dumps(envs)):
            group = asyncio.run(generate_group(request, engine, lambda: tok, Settings()))
    finally:
        engine.stop_scheduler()
    (t,) = group.trajectories
    chat = side["chat_tools"]
    messages = [{"role": "system", "content": chat["system"]}, {"role": "user", "content": "What is 2 + 3?"}]
    want = tok.apply_chat_template(messages, tools=chat["native_tools"], add_generation_prompt=True)
    want_ids = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert t.prompt_ids == want_ids and t.meta["env_prompt"] == "template"
    text = tok.decode(t.prompt_ids)
    assert text.startswith("<|im_start|>system\nUse the add tool for sums.\n\n# Tools\n")
    assert json.dumps(chat["native_tools"][0]) in text  # the schema as the template writes it
    assert t.meta["stop"] == "env_done" and t.segments[0].kind == "turn"
    assert_conditioned_on_its_prompt(model, t)
