"""Rollout modes: each turns one RolloutRequest into one Group using only the engine interface.

One module per mode (``plain``, ``streaming``, ``tree``, ``spawn``), each serving
``run(request, prompt_ids, group_id, engine, tokenizer, params, settings) -> Group`` with ``params``
its typed model from ``loom.contracts.modes`` (``tokenizer``: called only when text must be
tokenized). A mode that cannot run raises ``ModeError`` (bad parameters) or the engine's
``UnsupportedCapability`` (e.g. the group-position layout on vLLM); the API turns both into 422.
"""

from __future__ import annotations

import importlib
from typing import Any

from loom.contracts.modes import MODE_PARAMS, ModeError, ModeParams
from loom.contracts.wire import Group, Mode, RolloutRequest, Trajectory

__all__ = ["MODES", "ModeError", "group_of", "mode_runner", "sample_seed", "trajectory_id"]

# mode -> (its params model, the module whose ``run`` serves it): the contract's table of modes; a
# module is imported on first use, so a worker loads only the modes it serves.
MODES: dict[str, tuple[type[ModeParams], str]] = {
    name: (params, f"rollout_svc.modes.{name}") for name, params in MODE_PARAMS.items()
}


def mode_runner(mode: str) -> Any:
    """The ``run`` function serving ``mode`` (a key of ``MODES``)."""
    return importlib.import_module(MODES[mode][1]).run


def trajectory_id(group_id: str, index: int) -> str:
    return f"{group_id}/{index}"


def sample_seed(seed: int | None, index: int, round_: int = 0) -> int | None:
    """A distinct, reproducible seed per sample and round (None stays None: fresh randomness)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + index * 10_007 + round_) % (2**31)


def group_of(
    request: RolloutRequest, group_id: str, mode: Mode, trajectories: list[Trajectory], **structure: Any
) -> Group:
    """The group a mode returns: the request's prompt, label and task beside the trajectories and the
    mode's own structure (``tree``, ``threads``, ``meta``)."""
    return Group(
        id=group_id,
        mode=mode,
        prompt=request.prompt,
        label=request.label,
        task=request.task,
        trajectories=trajectories,
        **structure,
    )
