"""The built-in models by name (``LOOM_MODEL``): ``tiny`` (zoo/tiny, the fast model of the tests and
the demo), ``search`` (zoo/search, trained on Countdown search traces, issue 29), ``stream``
(zoo/search/stream.py: the search model fine-tuned on a wasteful streaming reading phase, issue 38)
``reflect`` (zoo/search/reflect.py: the search model reflecting mid-reasoning, issue 38) and ``deep``
(zoo/search/deep_train.py: the search model on four-number Countdown, spawn/join, issue 38); any
other value is a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

BUILTIN = ("tiny", "search", "stream", "reflect", "deep")


def resolve_model_path(model: str | Path) -> Path:
    """The checkpoint directory of a built-in model's name, or ``model`` itself as a path."""
    name = str(model)
    if name == "tiny":
        from zoo.tiny import CHECKPOINT_DIR

        return Path(CHECKPOINT_DIR)
    if name == "search":
        from zoo.search import SEARCH_CHECKPOINT_DIR

        return Path(SEARCH_CHECKPOINT_DIR)
    if name == "stream":
        from zoo.search import STREAM_CHECKPOINT_DIR

        return Path(STREAM_CHECKPOINT_DIR)
    if name == "reflect":
        from zoo.search import REFLECT_CHECKPOINT_DIR

        return Path(REFLECT_CHECKPOINT_DIR)
    if name == "deep":
        from zoo.search import DEEP_CHECKPOINT_DIR

        return Path(DEEP_CHECKPOINT_DIR)
    return Path(model)
