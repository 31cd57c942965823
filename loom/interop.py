"""How trainers' data becomes the text Loom scores (docs/interop-reward.md, "Labels and prompts").

Trainers pass the dataset's label through untouched (OpenRLHF, slime, verl, TRL): a string, a number,
a dict or list (verl's parquet rows hold numpy arrays). ``label_text`` is the one coercion every
protocol route and adapter applies; ``message_text`` flattens a chat-message prompt or completion.
Shared by the reward service's protocol routes and the trainer adapters in ``loom.clients``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any


class LabelError(ValueError):
    """A label no component can read (a boolean, NaN, an object): that item is refused, not the batch."""


def plain(value: Any) -> Any:
    """JSON-ready Python values: numpy arrays and scalars (``tolist``), mappings (OmegaConf's
    DictConfig too) and non-string sequences, recursively."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "tolist"):  # numpy arrays and scalars; torch tensors
        return plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence | set | frozenset):
        return [plain(v) for v in value]
    raise LabelError(f"a {type(value).__name__} is not JSON")


def label_text(value: Any) -> str | None:
    """The gold label as the text components read.

    - ``None`` stays ``None`` and a string stays as it is (an empty one too): the item's status is
      ``invalid`` ("group has no label");
    - an integer, or a float with an integral value, is its decimal digits (``5``, ``5.0`` -> ``"5"``);
      another finite float is its shortest round-trip text (``0.5`` -> ``"0.5"``);
    - a dict or list (numpy arrays included) is its JSON text: the Countdown task reads
      ``{"numbers": [...], "target": n}`` from it;
    - a boolean, NaN or an infinity raises ``LabelError`` (that item only is refused).
    """
    value = plain(value)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise LabelError("label is a boolean")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise LabelError("label is not a finite number")
        return str(int(value)) if value.is_integer() else repr(value)
    try:
        return json.dumps(value, allow_nan=False, ensure_ascii=False)
    except ValueError:
        raise LabelError("label holds a number that is not finite") from None


def message_text(value: Any) -> str:
    """A prompt or completion: a string, or chat messages (``[{"role", "content"}]``, where a
    content may be a list of parts such as ``{"type": "text", "text": ...}``) joined by newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return _content(value.get("content", ""))
    if isinstance(value, Sequence):
        return "\n".join(message_text(m) for m in value)
    return str(value)


def _content(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts = (p.get("text") if isinstance(p, Mapping) else p for p in content)
        return "\n".join(p for p in parts if isinstance(p, str))
    return "" if content is None else str(content)
