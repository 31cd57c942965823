"""The process reward model's prompt (docs/interop-reward.md "Process rewards"): one prompt per step
prefix, the steps so far fenced in a ``<steps>`` block no step can close, and the built-in template
``steps``. In the core, not the reward service, because two sides must write the very same text: the
reward service's ``process`` component, which asks a PRM, and whatever trains a PRM on Loom's prompts
(a model's recipe imports only ``loom``: docs/architecture.md, the walls).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

TEMPLATES = {
    "steps": (
        "Question:\n{question}\n\nSteps so far:\n{steps}\n\n"
        "Is the last step correct? Reply yes or no.\nVerdict:"
    ),
}
_PLACEHOLDER = re.compile(r"\{(question|steps)\}")
_TAG = re.compile(r"<\s*/?\s*steps\b[^>]*>?", re.IGNORECASE)


def template_text(template: str) -> str:
    """A built-in template's text, or the spec's own (``ProcessParams`` checked it has ``{steps}``)."""
    return TEMPLATES.get(template, template)


def _tail(text: str, max_chars: int | None) -> str:
    if max_chars is None or len(text) <= max_chars:
        return text
    return f"[... {len(text) - max_chars} characters cut ...]\n" + text[-max_chars:]


def fence_steps(steps: Sequence[str], max_step_chars: int | None = None, max_chars: int | None = None) -> str:
    """The steps joined by newlines in a ``<steps>`` block: every steps tag (even partial) dropped
    from each step, each step its last ``max_step_chars`` characters and the whole its last
    ``max_chars`` (the last step, the one judged, is at the end; a cut says how many went)."""
    body = "\n".join(_tail(_TAG.sub("", s), max_step_chars) for s in steps)
    return f"<steps>\n{_tail(body, max_chars)}\n</steps>"


def steps_prompt(
    template: str,
    question: str,
    steps: Sequence[str],
    max_step_chars: int | None = None,
    max_chars: int | None = None,
) -> str:
    """The PRM's prompt for the prefix ``steps`` (its last element the step judged); the placeholders
    filled in one pass, so a step holding ``{question}`` stays that text."""
    values = {"question": _TAG.sub("", question), "steps": fence_steps(steps, max_step_chars, max_chars)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template_text(template))
