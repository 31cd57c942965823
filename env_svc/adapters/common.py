"""What both library adapters share: chat messages rendered to the observation text the policy reads,
and library metadata made JSON-safe for ``EnvStep.meta`` (docs/environments.md, "Environment
libraries").

The libraries answer a turn with chat messages (``{"role", "content"}`` dicts, or pydantic models
with those fields; content a string or a list of typed parts). Loom's agent episode is one running
token sequence, so the observation is the messages' text, one message per line in order; the
messages themselves, with their roles, go to ``meta`` for whoever reads the episode back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any


def _field(message: Any, name: str) -> Any:
    if isinstance(message, dict):
        return message.get(name)
    return getattr(message, name, None)


def message_text(message: Any) -> str:
    """A message's text: its string content, or its text parts joined (other parts named)."""
    content = _field(message, "content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts: list[str] = []
    for part in content if isinstance(content, list) else [content]:
        kind = _field(part, "type")
        text = _field(part, "text")
        parts.append(text if isinstance(text, str) else f"[{kind or 'part'}]")
    return "".join(parts)


def render(messages: Iterable[Any]) -> str:
    """The observation text of the messages an environment answered with."""
    return "\n".join(message_text(m) for m in messages)


def plain_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    """The messages as plain ``{"role", "content"}`` dicts (plus a tool message's call id)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        row: dict[str, Any] = {"role": str(_field(m, "role") or ""), "content": message_text(m)}
        call_id = _field(m, "tool_call_id")
        if isinstance(call_id, str):
            row["tool_call_id"] = call_id
        out.append(row)
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def json_safe(value: Any) -> Any:
    """``value`` as JSON types (what JSON cannot hold written by ``str``; NaN and inf as strings),
    so a library's metadata always fits the wire's ``meta``."""
    return _finite(json.loads(json.dumps(value, default=str)))
