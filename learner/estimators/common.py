"""What several estimators share: the group normalisation N_G, the per-token ``TokenAdvantages`` and
the token masks, and the reward lookup (docs/algorithms.md §5.1-5.2).

Token conventions (completion-token offsets, aligned with ``completion_ids``): the trained tokens
are ``loss_mask`` (default all 1) AND not inside an ``observation`` segment; observation tokens are
never trained by any estimator or loss term.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loom.contracts.estimators import EPS
from loom.contracts.wire import StepScore, Trajectory, TrajectoryReward


def group_normalize(x: Sequence[float], *, eps: float = EPS, scale: bool = True) -> list[float]:
    """N_G(x) = (x - mean) / (std + eps) with the population std; zero variance -> all zeros."""
    n = len(x)
    if n == 0:
        return []
    mean = sum(x) / n
    centred = [v - mean for v in x]
    var = sum(c * c for c in centred) / n
    if var <= 1e-12:  # zero variance (includes a single sample): no relative signal
        return [0.0] * n
    if not scale:
        return centred
    std = math.sqrt(var)
    return [c / (std + eps) for c in centred]


@dataclass
class TokenAdvantages:
    """Per-token training signal of one trajectory.

    ``adv`` is the advantage every trained token gets (A^g for HRPO); ``adv_stream``/``adv_deep``
    and ``stream_mask`` are set for HRPO only; ``weight`` scales the trajectory's loss (APR: 1/calls).
    """

    trajectory: Trajectory
    adv: list[float]
    mask: list[int]
    adv_stream: list[float] | None = None
    adv_deep: list[float] | None = None
    stream_mask: list[int] | None = None
    weight: float = 1.0
    group_id: str = ""

    @property
    def is_zero(self) -> bool:
        """True when no trained token carries a non-zero advantage (the sample teaches nothing)."""
        lists = [self.adv, self.adv_stream or [], self.adv_deep or []]
        return not any(a != 0.0 and m for xs in lists for a, m in zip(xs, self.mask, strict=False))


def trained_mask(t: Trajectory) -> list[int]:
    n = len(t.completion_ids)
    mask = list(t.loss_mask) if t.loss_mask is not None else [1] * n
    for seg in t.segments:
        if seg.kind == "observation":
            for j in range(seg.start, seg.end):
                mask[j] = 0
    return mask


def kind_mask(t: Trajectory, kind: str) -> list[int]:
    out = [0] * len(t.completion_ids)
    for seg in t.segments:
        if seg.kind == kind:
            for j in range(seg.start, seg.end):
                out[j] = 1
    return out


def uniform(a: float, mask: Sequence[int]) -> list[float]:
    """``a`` on every trained token, 0 elsewhere."""
    return [a if m else 0.0 for m in mask]


def reward_of(rewards: Mapping[str, TrajectoryReward], t: Trajectory) -> TrajectoryReward:
    if t.id not in rewards:
        raise ValueError(f"trajectory {t.id} of group {t.group_id} has no reward")
    return rewards[t.id]


def reward_value(r: TrajectoryReward, key: str | None) -> float:
    """The reward an estimator ranks by: the total (``key`` None or 'total') or one component."""
    if key is None or key == "total":
        return float(r.total)
    if key not in r.components:
        raise ValueError(f"reward of trajectory {r.trajectory_id} has no component {key!r}")
    return float(r.components[key])


def scalar_rewards(
    trajs: Sequence[Trajectory], rewards: Mapping[str, TrajectoryReward], key: str | None
) -> list[float]:
    """R_i of every trajectory of the group, in order."""
    return [reward_value(reward_of(rewards, t), key) for t in trajs]


def uniform_assign(trajs: Sequence[Trajectory], adv: Sequence[float]) -> list[TokenAdvantages]:
    """One scalar advantage per trajectory, given to each of its trained tokens."""
    out = []
    for t, a in zip(trajs, adv, strict=True):
        m = trained_mask(t)
        out.append(TokenAdvantages(t, uniform(a, m), m))
    return out


def step_scores(
    group_id: str, trajs: Sequence[Trajectory], rewards: Mapping[str, TrajectoryReward], key: str
) -> dict[str, list[StepScore]]:
    """Each trajectory's step scores under component ``key`` (docs/algorithms.md §5.4), checked: a
    group with none, a scored (``ok``) trajectory without its own, character offsets or a span outside
    the completion are a ValueError (the batch is refused: a step estimator without step scores would
    silently train on the outcome alone). A trajectory whose PRM failed (a typed status) has none."""
    out: dict[str, list[StepScore]] = {}
    for t in trajs:
        r = reward_of(rewards, t)
        steps = (r.steps or {}).get(key)
        if steps is None:
            if r.status == "ok":
                raise ValueError(
                    f"trajectory {t.id} of group {group_id} has no step scores of component {key!r}: "
                    f"score the batch with the process reward (docs/interop-reward.md)"
                )
            continue
        for s in steps:
            if s.unit != "token":
                raise ValueError(
                    f"trajectory {t.id}: step scores in character offsets (scored without its token ids)"
                )
            if not s.start < s.end <= len(t.completion_ids):
                raise ValueError(f"trajectory {t.id}: step [{s.start}, {s.end}) outside its completion")
        out[t.id] = list(steps)
    if not out:
        raise ValueError(f"group {group_id} has no step scores of component {key!r}")
    return out
