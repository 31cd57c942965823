"""Loom's built-in code model: generated programming problems with tests (``tasks``), its trace
format (``traces``: a fenced Python block), its held-out evaluation in the sandbox (``evaluate``)
and its row of the recipe table (``train``; docs/models.md "The code model"). Its tokenizer and
architecture are the tiny model's (zoo/tiny), trained from scratch on the code traces."""

from __future__ import annotations

from zoo.code.tasks import HELDOUT_SEED, CodeProblem, code_problems, code_prompt, is_held_out
from zoo.registry import CHECKPOINTS

CODE_CHECKPOINT_DIR = CHECKPOINTS["code"]

__all__ = [
    "CODE_CHECKPOINT_DIR",
    "HELDOUT_SEED",
    "CodeProblem",
    "code_problems",
    "code_prompt",
    "is_held_out",
]
