"""Rollout modes: each turns one RolloutRequest into one Group using only the engine interface.

One module per mode (``plain``, ``streaming``, ``tree``, ``spawn``), each the algorithm only: a
function named after the mode, ``mode(request, prompt_ids, group_id, engine, tokenizer, params)``
with ``params`` its typed model from ``loom.contracts.modes`` (``plain`` takes the first four alone;
``tree`` also takes its reward callback and scorer, from ``rollout_svc.modes.scorers``). ``run`` is
the one dispatch entry that feeds them. A mode that cannot run raises ``ModeError`` (bad
parameters) or the engine's ``UnsupportedCapability`` (e.g. the group-position layout on vLLM); the
API turns both into 422.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any

from loom.contracts.modes import MODE_PARAMS, ModeError, ModeParams
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, Mode, RolloutRequest, Trajectory
from rollout_svc.engines.base import Engine

__all__ = ["MODES", "ModeError", "group_of", "mode_runner", "run", "sample_seed", "trajectory_id"]

# mode -> (its params model, the module of its algorithm): the contract's table of modes; a module
# is imported on first use, so a worker loads only the modes it serves.
MODES: dict[str, tuple[type[ModeParams], str]] = {
    name: (params, f"rollout_svc.modes.{name}") for name, params in MODE_PARAMS.items()
}


def mode_runner(mode: str) -> Any:
    """The algorithm serving ``mode`` (a key of ``MODES``): its module's function of the same name."""
    return getattr(importlib.import_module(MODES[mode][1]), mode)


async def run(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Callable[[], Any],
    params: ModeParams,
    settings: Settings,
) -> Group:
    """The dispatch entry of every mode: ``tokenizer()`` is called only for a mode that reads text
    (every mode but ``plain``); ``tree`` also gets what ``scorers.tree_inputs`` builds from the
    deployment's ``settings`` (the other modes' limits are already in ``params``)."""
    algorithm: Callable[..., Awaitable[Group]] = mode_runner(request.mode)
    if request.mode == "plain":
        return await algorithm(request, prompt_ids, group_id, engine)
    tok = tokenizer()
    extras: dict[str, Any] = {}
    if request.mode == "tree":
        from rollout_svc.modes.scorers import tree_inputs

        extras = tree_inputs(request, tok, params, settings)
    return await algorithm(request, prompt_ids, group_id, engine, tok, params, **extras)


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
