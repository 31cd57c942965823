"""Step-level GRPO (docs/algorithms.md §5.4): the outcome advantage of GRPO plus a process term from a
PRM's step scores (the ``process`` reward's ``steps``), each step's score normalised over the group's
steps at the same depth, given to that step's tokens:

    A_{i,t} = N_G(R)_i + c * N_{G_k}(r_{.,k})_i    for token t in step k of trajectory i
    G_k = {j : trajectory j has a k-th step}

Tokens in no step get the outcome term alone; untrained tokens 0. A group without step scores is
refused (``common.step_scores``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from learner.estimators.common import (
    TokenAdvantages,
    group_normalize,
    scalar_rewards,
    step_scores,
    trained_mask,
)
from loom.contracts.estimators import EPS, StepGrpoParams
from loom.contracts.wire import Group, StepScore, TrajectoryReward


def step_advantages(steps: Sequence[Sequence[float]], *, eps: float = EPS) -> list[list[float]]:
    """N_{G_k}: each step's score normalised over the group's k-th steps (a depth one trajectory
    reaches alone, or of equal scores, gives 0)."""
    out = [[0.0] * len(s) for s in steps]
    depth = max((len(s) for s in steps), default=0)
    for k in range(depth):
        members = [i for i, s in enumerate(steps) if len(s) > k]
        for i, a in zip(members, group_normalize([steps[i][k] for i in members], eps=eps), strict=True):
            out[i][k] = a
    return out


def step_grpo(
    outcomes: Sequence[float], steps: Sequence[Sequence[float]], coef: float, *, eps: float = EPS
) -> tuple[list[float], list[list[float]]]:
    """(N_G(R)_i, c * N_{G_k}(r_{.,k})_i): the outcome term of each trajectory and its steps' terms."""
    return group_normalize(outcomes, eps=eps), [
        [coef * a for a in row] for row in step_advantages(steps, eps=eps)
    ]


def assign(group: Group, rewards: Mapping[str, TrajectoryReward], p: StepGrpoParams) -> list[TokenAdvantages]:
    """Each trained token: its trajectory's outcome term plus the term of the step it lies in."""
    trajs = group.trajectories
    scored = step_scores(group.id, trajs, rewards, p.process_key)
    spans: list[list[StepScore]] = [scored.get(t.id, []) for t in trajs]
    scores = [[s.score for s in row] for row in spans]
    outcomes = scalar_rewards(trajs, rewards, p.reward_key)
    outcome, terms = step_grpo(outcomes, scores, p.process_coef, eps=p.eps)
    out = []
    for t, a, row, term in zip(trajs, outcome, spans, terms, strict=True):
        m = trained_mask(t)
        adv = [a] * len(m)
        for s, extra in zip(row, term, strict=True):
            for j in range(s.start, s.end):
                adv[j] = a + extra
        out.append(TokenAdvantages(t, [x if keep else 0.0 for x, keep in zip(adv, m, strict=True)], m))
    return out
