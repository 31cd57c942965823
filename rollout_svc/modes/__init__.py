"""Rollout modes: each turns one RolloutRequest into one Group using only the engine interface.

One module per mode (``plain``, ``streaming``, ``tree``, ``spawn``, ``agent``), each the algorithm only: a
function named after the mode, ``mode(request, prompt_ids, group_id, engine, *needs)``, and ``NEEDS``,
the names of what it takes beyond the first four, in its signature's order, each given by the
dispatch's :data:`PROVIDERS` (``"tokenizer"``; ``"params"``, its typed model from
``loom.contracts.modes``; ``"reward_fn"`` and ``"scorer"``, tree mode's reward callback and attention
scorer from ``rollout_svc.modes.scorers``). A mode's registration is its line in the contract's table
(``loom.contracts.modes.MODE_PARAMS``), its module ``rollout_svc/modes/<name>.py`` found by that name:
a new mode is that file plus that line (docs/architecture.md, "One registration per feature"). ``run``
is the one dispatch entry. A mode that cannot run raises ``ModeError`` (bad parameters) or the
engine's ``UnsupportedCapability`` (e.g. the group-position layout on vLLM); the API turns both into
422.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from loom.contracts.modes import MODE_PARAMS, ModeError, ModeParams
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, Mode, RolloutRequest, Segment, SegmentKind, Trajectory
from rollout_svc.engines.base import Engine

__all__ = [
    "MODES",
    "Inputs",
    "PROVIDERS",
    "Tokens",
    "ModeError",
    "group_of",
    "mode_needs",
    "mode_runner",
    "run",
    "sample_seed",
    "trajectory_id",
]

# mode -> (its params model, the module of its algorithm), from the contract's table of modes; a
# module is imported on first use, so a worker loads only the modes it serves.
MODES: dict[str, tuple[type[ModeParams], str]] = {
    name: (params, f"rollout_svc.modes.{name}") for name, params in MODE_PARAMS.items()
}


def _module(mode: str) -> Any:
    if mode not in MODE_PARAMS:
        raise ModeError(f"unknown mode {mode!r}; available: {tuple(MODE_PARAMS)}")
    return importlib.import_module(f"rollout_svc.modes.{mode}")


def mode_runner(mode: str) -> Any:
    """The algorithm serving ``mode`` (a key of ``MODE_PARAMS``): its module's function of the same name."""
    return getattr(_module(mode), mode)


def mode_needs(mode: str) -> tuple[str, ...]:
    """What ``mode``'s algorithm takes beyond (request, prompt_ids, group_id, engine): its ``NEEDS``."""
    return tuple(getattr(_module(mode), "NEEDS", ()))


@dataclass
class Inputs:
    """What the providers build a mode's needs from; the tokenizer is loaded only when one is needed."""

    request: RolloutRequest
    load_tokenizer: Callable[[], Any]
    params: ModeParams
    settings: Settings

    @cached_property
    def tokenizer(self) -> Any:
        return self.load_tokenizer()


def _reward_fn(i: Inputs) -> Any:
    from rollout_svc.modes.scorers import exact_reward_fn

    return exact_reward_fn(i.request, i.tokenizer)


def _scorer(i: Inputs) -> Any:
    from rollout_svc.modes.scorers import operator_scorer

    return operator_scorer(i.settings, i.params)


# need -> how the dispatch provides it (a mode names the ones it takes in its NEEDS)
PROVIDERS: dict[str, Callable[[Inputs], Any]] = {
    "tokenizer": lambda i: i.tokenizer,
    "params": lambda i: i.params,
    "reward_fn": _reward_fn,
    "scorer": _scorer,
}


async def run(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Callable[[], Any],
    params: ModeParams,
    settings: Settings,
) -> Group:
    """The dispatch entry of every mode: its algorithm called with what its ``NEEDS`` name
    (``tokenizer()`` is called only for a mode that needs text; ``settings``: the deployment's, which
    the operator's scorer reads)."""
    algorithm: Callable[..., Awaitable[Group]] = mode_runner(request.mode)
    inputs = Inputs(request, tokenizer, params, settings)
    needs = [PROVIDERS[need](inputs) for need in mode_needs(request.mode)]
    return await algorithm(request, prompt_ids, group_id, engine, *needs)


def trajectory_id(group_id: str, index: int) -> str:
    return f"{group_id}/{index}"


def sampled(engine: Engine, tid: str, group_id: str, prompt_ids: Sequence[int], **fields: Any) -> Trajectory:
    """A trajectory the engine sampled: its log-prob kind, policy version and name stamped by one
    place, so that no mode can leave out what the learner checks its log-probs against
    (docs/algorithms.md, behaviour log-probs)."""
    return Trajectory(
        id=tid,
        group_id=group_id,
        prompt_ids=list(prompt_ids),
        logprobs_kind=engine.logprobs_kind,
        policy_version=engine.policy_version,
        engine=engine.name,
        **fields,
    )


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


@dataclass(kw_only=True)
class Tokens:
    """A completion being built, in order: its token ids, their log-probs, the loss mask (1: trained)
    and its segments. A mode's own state (an agent's episode, a spawn call) extends it and numbers
    its segments (``segment_index``)."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    def segment_index(self) -> int:
        """The ``index`` of the segment appended next (a turn's, a span's)."""
        return 0

    def append(
        self, ids: list[int], logprobs: list[float], trained: int, kind: SegmentKind, meta: dict
    ) -> None:
        start = len(self.ids)
        self.ids += ids
        self.logprobs += logprobs
        self.mask += [trained] * len(ids)
        self.segments.append(
            Segment(kind=kind, start=start, end=len(self.ids), index=self.segment_index(), meta=meta)
        )
