"""Per-step run metrics from scored groups. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean, pvariance

from loom.contracts.wire import Group, RewardResult


def _totals(group: Group, result: RewardResult) -> list[float]:
    by_id = {r.trajectory_id: r.total for r in result.rewards}
    return [by_id.get(t.id, 0.0) for t in group.trajectories]


def has_signal(group: Group, result: RewardResult) -> bool:
    """Non-zero reward variance in the group, or (adaptive) in its pool: a non-zero advantage exists."""
    totals = _totals(group, result)
    if len(totals) > 1 and pvariance(totals) > 0:
        return True
    pool = group.pool
    if pool is not None and pool.n_sampled > 0:
        mean = pool.reward_sum / pool.n_sampled
        return any(abs(r - mean) > 1e-12 for r in totals)
    return False


def step_metrics(
    kept: Sequence[tuple[Group, RewardResult] | None],
    sampled: Sequence[tuple[Group, RewardResult]],
    gen_seconds: float,
    accuracy_threshold: float = 0.5,
) -> dict[str, float]:
    """reward, accuracy, lengths, zero-variance ratio and generation tokens/s of one step."""
    rewards: list[float] = []
    correct: list[float] = []
    lengths: list[int] = []
    for item in kept:
        if item is None:
            continue
        group, result = item
        by_id = {r.trajectory_id: r for r in result.rewards}
        for t in group.trajectories:
            r = by_id.get(t.id)
            total = r.total if r else 0.0
            rewards.append(total)
            acc = r.components.get("accuracy", total) if r else 0.0
            correct.append(1.0 if acc > accuracy_threshold else 0.0)
            lengths.append(len(t.completion_ids))
    all_rewards = [x for g, res in sampled for x in _totals(g, res)]
    tokens = sum(len(t.completion_ids) for g, _ in sampled for t in g.trajectories)
    n_prompts = len(kept)
    with_signal = sum(1 for item in kept if item is not None and has_signal(*item))
    return {
        "reward_mean": fmean(rewards) if rewards else 0.0,
        "reward_mean_sampled": fmean(all_rewards) if all_rewards else 0.0,
        "accuracy": fmean(correct) if correct else 0.0,
        "length_mean": fmean(lengths) if lengths else 0.0,
        "length_max": float(max(lengths)) if lengths else 0.0,
        "groups": float(sum(1 for k in kept if k is not None)),
        "groups_with_signal": float(with_signal),
        "zero_variance_ratio": (n_prompts - with_signal) / n_prompts if n_prompts else 0.0,
        "gen_tokens": float(tokens),
        "gen_seconds": gen_seconds,
        "tokens_per_s": tokens / gen_seconds if gen_seconds > 0 else 0.0,
    }
