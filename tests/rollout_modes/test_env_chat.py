"""A chat environment's prompt (rollout_svc/modes/env_chat.py, docs/environments.md "The policy's
prompt"): the system prompt and tool schemas rendered with the question through a tools-aware chat
template (Qwen3's own, on a Qwen3-style tokenizer), folded into the system message where the template
ignores ``tools=`` (Loom's tiny model), written as plain text where there is no template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from loom.contracts.envs import EnvChat
from rollout_svc.modes.env_chat import ChatError, render_chat, system_text
from tests.qwen3_style import qwen3_chat_template, qwen3_style_tokenizer

TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
CHAT = EnvChat(system="Use the add tool for sums.", tools=[TOOL])
QUESTION = "What is 2 + 3?"


@pytest.fixture(scope="module")
def qwen3() -> Any:
    tok = qwen3_style_tokenizer()
    tok.chat_template = qwen3_chat_template()
    return tok


@pytest.fixture(scope="module")
def tiny() -> Any:
    from transformers import AutoTokenizer

    from zoo.tiny import CHECKPOINT_DIR

    return AutoTokenizer.from_pretrained(CHECKPOINT_DIR)


def _ids(out: Any) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_a_tools_aware_template_renders_the_system_turn_and_tools_itself(qwen3: Any) -> None:
    r = render_chat(qwen3, QUESTION, CHAT)
    messages = [{"role": "system", "content": CHAT.system}, {"role": "user", "content": QUESTION}]
    assert r.how == "template"
    want = qwen3.apply_chat_template(messages, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    assert r.text == want
    assert r.ids == _ids(qwen3.apply_chat_template(messages, tools=[TOOL], add_generation_prompt=True))
    assert r.text.startswith("<|im_start|>system\nUse the add tool for sums.\n\n# Tools\n")
    assert r.text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    # the fallback writes each schema as the Qwen3 template does
    assert "\n" + json.dumps(TOOL) + "\n</tools>" in r.text


def test_a_template_that_ignores_tools_gets_them_in_the_system_message(tiny: Any) -> None:
    ignored = tiny.apply_chat_template([{"role": "user", "content": "x"}], tools=[TOOL], tokenize=False)
    assert "add" not in ignored  # the tiny template drops tools=: the fallback must carry them
    r = render_chat(tiny, QUESTION + "\n", CHAT)
    block = "Use the add tool for sums.\n\n# Tools\n<tools>\n" + json.dumps(TOOL) + "\n</tools>"
    assert system_text(CHAT) == block
    assert r.how == "fallback" and r.text == block + "\n" + QUESTION + "\n"
    assert r.ids == list(tiny.encode(r.text, add_special_tokens=False))
    assert render_chat(tiny, QUESTION + "\n", CHAT) == r  # deterministic


def test_a_system_prompt_alone_and_tools_alone(tiny: Any, qwen3: Any) -> None:
    only_system = render_chat(tiny, "Guess.\n", EnvChat(system="You play a guessing game."))
    assert only_system.how == "template" and only_system.text == "You play a guessing game.\nGuess.\n"
    only_tools = render_chat(tiny, "Q\n", EnvChat(tools=[TOOL]))
    assert only_tools.how == "fallback" and only_tools.text.startswith("# Tools\n<tools>\n")
    r = render_chat(qwen3, QUESTION, EnvChat(tools=[TOOL]))
    assert r.how == "template" and r.text.startswith("<|im_start|>system\n# Tools\n")


def test_a_template_that_drops_the_system_message_gets_it_in_the_user_turn() -> None:
    tok = qwen3_style_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m.role != 'system' %}[{{ m.content }}]{% endif %}{% endfor %}"
    )
    r = render_chat(tok, QUESTION, CHAT)
    assert r.how == "fallback" and r.text == f"[{system_text(CHAT)}\n\n{QUESTION}]"
    alone = render_chat(tok, QUESTION, EnvChat(system="Be brief."))
    assert alone.how == "fallback" and alone.text == f"[Be brief.\n\n{QUESTION}]"


def test_no_template_is_plain_text_and_a_refusing_template_is_an_error() -> None:
    tok = qwen3_style_tokenizer()
    r = render_chat(tok, QUESTION, CHAT)
    assert r.how == "plain" and r.text == system_text(CHAT) + "\n\n" + QUESTION
    tok.chat_template = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(ChatError, match="System role not supported"):
        render_chat(tok, QUESTION, CHAT)
