"""A chat environment's prompt (docs/environments.md, "The policy's prompt"): the system prompt and
tool schemas an environment would send a chat model (``EnvChat``), with the task's question as the
user turn, rendered as the policy's own chat template renders them for that model. How it was
rendered is the trajectory's ``env_prompt``:

- ``template``: the tokenizer's chat template given the system message and ``tools=`` (transformers'
  ``apply_chat_template``, the generation prompt added), where the template renders tools (its text
  with them differs from its text without them);
- ``fallback``: a template that ignores ``tools=`` (Loom's tiny models): the tools are folded into the
  system message in the Hermes style of the Qwen2.5/Qwen3 templates (``system_text``), and the
  template renders that system message and the user message; a template that drops a system message
  too gets that system text, a blank line and the question as the user message;
- ``plain``: a tokenizer without a chat template: that system text, a blank line, the question.

The tools are never dropped, and every rendering is a function of its inputs alone. The ids are the
text encoded once (special tokens' text as their ids, no BOS added: what ``apply_chat_template``
with ``tokenize=True`` gives): the ids the policy is conditioned on, and the trajectory's
``prompt_ids``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from loom.contracts.envs import EnvChat

How = Literal["template", "fallback", "plain"]

# The fallback's tools block, in the Hermes style of the Qwen2.5/Qwen3 templates' system turn and kept
# short for the tiny models' 512-token context: the schemas within <tools></tools>, each one JSON line
# as those templates' ``tojson`` writes it (json.dumps, non-ASCII kept). It names no call syntax: that
# is the agent's parser's (loom/tools.py), which a model without a tools-aware template is trained on.
TOOLS_OPEN, TOOLS_CLOSE = "# Tools\n<tools>", "\n</tools>"


class ChatError(ValueError):
    """The policy's chat template could not render the environment's prompt."""


@dataclass(frozen=True)
class Rendered:
    text: str
    ids: list[int]
    how: How


def system_text(chat: EnvChat) -> str:
    """The system message with the tools folded in: the system prompt, a blank line, the tools block
    (each schema a JSON line)."""
    if not chat.tools:
        return chat.system or ""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in chat.tools)
    block = TOOLS_OPEN + lines + TOOLS_CLOSE
    return f"{chat.system}\n\n{block}" if chat.system else block


def _template(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None) -> str:
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # a template's own refusal (jinja2 errors, a role it does not take)
        why = f"the policy's chat template could not render the environment's prompt: {exc}"
        raise ChatError(why) from None
    return str(text)


def render_chat(tokenizer: Any, question: str, chat: EnvChat) -> Rendered:
    """The policy's prompt: ``chat``'s system prompt and tools, ``question`` the user turn."""
    user = {"role": "user", "content": question}
    system = [{"role": "system", "content": chat.system}] if chat.system else []
    if not getattr(tokenizer, "chat_template", None):
        text = f"{system_text(chat)}\n\n{question}"
        return Rendered(text, list(tokenizer.encode(text, add_special_tokens=False)), "plain")
    how: How = "template"
    text = _template(tokenizer, [*system, user], chat.tools or None)
    if chat.tools and text == _template(tokenizer, [*system, user], None):
        how = "fallback"  # the template ignores tools=: they go into the system message
        text = _template(tokenizer, [{"role": "system", "content": system_text(chat)}, user], None)
    if system and _template(tokenizer, [user], None) == _template(tokenizer, [*system, user], None):
        how = "fallback"  # nor does it render a system message: all of it opens the user turn
        text = _template(tokenizer, [{"role": "user", "content": f"{system_text(chat)}\n\n{question}"}], None)
    return Rendered(text, list(tokenizer.encode(text, add_special_tokens=False)), how)
