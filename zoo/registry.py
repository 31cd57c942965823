"""The built-in models by name (``LOOM_MODEL``; docs/models.md): ``tiny`` (zoo/tiny, the fast model of
the tests and the demo), ``search`` (zoo/search, trained on Countdown search traces), and three
fine-tunes of it: ``stream`` (a wasteful streaming reading phase), ``reflect`` (reflecting
mid-reasoning), ``deep`` (four-number Countdown, spawn/join) and ``judge`` (grading answers and
steps: the judge reward's built-in judge); ``code`` (zoo/code, writing the
Python function a generated problem asks for); ``tool`` (zoo/tiny/tool.py, the tiny model fine-tuned to
call the calculator in agent mode). Any other value is a Hugging Face
model directory. How each is trained is its row of zoo/recipes.py (``loom train-<name>``).

Light on purpose: the services resolve a name at start-up and import nothing of the recipes.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

# name -> its checkpoint folder (weights, tokenizer, card), shipped as package data (pyproject.toml)
CHECKPOINTS: dict[str, Path] = {
    "tiny": _HERE / "tiny" / "checkpoint",
    "search": _HERE / "search" / "checkpoint",
    "stream": _HERE / "search" / "stream_checkpoint",
    "reflect": _HERE / "search" / "reflect_checkpoint",
    "deep": _HERE / "search" / "deep_checkpoint",
    "code": _HERE / "code" / "checkpoint",
    "tool": _HERE / "tiny" / "tool_checkpoint",
    "judge": _HERE / "search" / "judge_checkpoint",
}
BUILTIN = tuple(CHECKPOINTS)


def resolve_model_path(model: str | Path) -> Path:
    """The checkpoint directory of a built-in model's name, or ``model`` itself as a path."""
    return CHECKPOINTS.get(str(model), Path(model))
