"""Loom's second built-in model: a small Llama trained by ``loom train-search`` on
Countdown search traces (zoo/search/traces.py) in the plain, reflect, stream and spawn formats, plus
the tiny model's arithmetic. The prompts, markers and parsers are the tiny model's (zoo.tiny), so
every rollout mode serves either model; ``zoo.tiny`` stays the fast model of the tests.

Stable API: SEARCH_CHECKPOINT_DIR, load_model(path=None), load_tokenizer(path=None), search_problems.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zoo.registry import CHECKPOINTS
from zoo.search.tasks import MAX_SOLVING, SEARCH_KNOBS, search_problems, solving_moves
from zoo.tiny import load_model as _load_model
from zoo.tiny import load_tokenizer as _load_tokenizer

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

SEARCH_CHECKPOINT_DIR = CHECKPOINTS["search"]
# its three fine-tunes (zoo/recipes.py): a wasteful reading phase, reflecting mid-reasoning (REA-RL),
# four-number Countdown (APR)
STREAM_CHECKPOINT_DIR = CHECKPOINTS["stream"]
REFLECT_CHECKPOINT_DIR = CHECKPOINTS["reflect"]
DEEP_CHECKPOINT_DIR = CHECKPOINTS["deep"]


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    return _load_tokenizer(path or SEARCH_CHECKPOINT_DIR)


def load_model(path: str | Path | None = None, **kwargs: object) -> LlamaForCausalLM:
    return _load_model(path or SEARCH_CHECKPOINT_DIR, **kwargs)


__all__ = [
    "DEEP_CHECKPOINT_DIR",
    "MAX_SOLVING",
    "REFLECT_CHECKPOINT_DIR",
    "SEARCH_CHECKPOINT_DIR",
    "SEARCH_KNOBS",
    "STREAM_CHECKPOINT_DIR",
    "load_model",
    "load_tokenizer",
    "search_problems",
    "solving_moves",
]
