"""Rollout modes: each turns one RolloutRequest into one Group using only the engine interface.

``plain`` (n samples) and ``streaming`` (AdaSR / StreamingThinker) live here, one file each.
A mode that cannot run raises ``ModeError`` (bad parameters) or the engine's
``UnsupportedCapability`` (e.g. the group-position layout on vLLM); the API turns both into 422.
"""

from __future__ import annotations

from typing import Any

# Modes served through ``run(request, prompt_ids, group_id, engine, tokenizer) -> Group`` (imported
# lazily by name so a worker loads only what it serves): tree (TreeRL / AttnRL), spawn (APR).
RUN_MODES = {"tree": "rollout_svc.modes.tree", "spawn": "rollout_svc.modes.spawn"}


class ModeError(ValueError):
    """The request asks a mode for something it cannot do; the message names the limit."""

    kind = "mode_error"


def trajectory_id(group_id: str, index: int) -> str:
    return f"{group_id}/{index}"


def sample_seed(seed: int | None, index: int, round_: int = 0) -> int | None:
    """A distinct, reproducible seed per sample and round (None stays None: fresh randomness)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * 10_007 + round_) % (2**31)


def param(mode_params: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = mode_params.get(name, default)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ModeError(f"mode_params.{name} must be {kind.__name__}, got {type(value).__name__}")
    return value
