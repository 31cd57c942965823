"""Loom's built-in tiny model: synthetic tasks, traces in every format, tokenizer, model, training.

Stable API for the services:
    CHECKPOINT_DIR, load_tokenizer(path=None), load_model(path=None)
    tasks: Problem, make_problems(kind, n, seed, split)
    prompts: plain_prompt, reflect_prompt, spawn_prompt, child_prompt, stream_prompt, stream_connector
    parsing: parse_stream, split_stream_text, parse_spawn, child_message, join_block (the boxed answer:
    loom.answers.last_boxed)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from zoo.registry import CHECKPOINTS
from zoo.tiny.tasks import HELDOUT_SEED, TINY_KNOBS, Problem, is_held_out, make_problems, tiny_problems
from zoo.tiny.traces import (
    FORMATS,
    STREAM_HEADER,
    child_message,
    child_prompt,
    join_block,
    parse_spawn,
    parse_stream,
    plain_prompt,
    reflect_prompt,
    spawn_prompt,
    split_stream_text,
    stream_connector,
    stream_prompt,
)

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

CHECKPOINT_DIR = CHECKPOINTS["tiny"]


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerFast:
    _offline()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path or CHECKPOINT_DIR))  # type: ignore[return-value]


def load_model(path: str | Path | None = None, **kwargs: object) -> LlamaForCausalLM:
    """The checkpoint in eval mode (float32, eager attention unless ``attn_implementation`` given)."""
    _offline()
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("attn_implementation", "eager")
    model = AutoModelForCausalLM.from_pretrained(str(path or CHECKPOINT_DIR), **kwargs)
    model.eval()
    return model  # type: ignore[return-value]


__all__ = [
    "CHECKPOINT_DIR",
    "HELDOUT_SEED",
    "TINY_KNOBS",
    "tiny_problems",
    "FORMATS",
    "STREAM_HEADER",
    "Problem",
    "child_message",
    "child_prompt",
    "is_held_out",
    "join_block",
    "load_model",
    "load_tokenizer",
    "make_problems",
    "parse_spawn",
    "parse_stream",
    "plain_prompt",
    "reflect_prompt",
    "spawn_prompt",
    "split_stream_text",
    "stream_connector",
    "stream_prompt",
]
