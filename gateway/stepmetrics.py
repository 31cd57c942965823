"""Per-step run metrics and sample trajectories from scored groups. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean, pstdev, pvariance
from typing import Any

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
    """reward (total and per component), accuracy, lengths, group advantages, verification statuses,
    zero-variance ratio and generation tokens/s of one step."""
    rewards: list[float] = []
    correct: list[float] = []
    lengths: list[int] = []
    components: dict[str, list[float]] = {}
    statuses: dict[str, int] = {}
    truncated: list[float] = []
    advantages: list[float] = []
    for item in kept:
        if item is None:
            continue
        group, result = item
        by_id = {r.trajectory_id: r for r in result.rewards}
        totals = _totals(group, result)
        # the group-relative advantage r_i - mean(r) (GRPO's numerator, docs/algorithms.md §5.1): the
        # learner's own per-token advantages depend on the estimator and are in learner/adv_abs_mean
        baseline = fmean(totals) if totals else 0.0
        advantages.extend(x - baseline for x in totals)
        for t in group.trajectories:
            r = by_id.get(t.id)
            total = r.total if r else 0.0
            rewards.append(total)
            acc = r.components.get("accuracy", total) if r else 0.0
            correct.append(1.0 if acc > accuracy_threshold else 0.0)
            lengths.append(len(t.completion_ids))
            truncated.append(1.0 if t.finish_reason == "length" else 0.0)
            status = r.status if r else "missing"
            statuses[status] = statuses.get(status, 0) + 1
            for name, value in (r.components if r else {}).items():
                components.setdefault(name, []).append(float(value))
    all_rewards = [x for g, res in sampled for x in _totals(g, res)]
    tokens = sum(len(t.completion_ids) for g, _ in sampled for t in g.trajectories)
    n_prompts = len(kept)
    with_signal = sum(1 for item in kept if item is not None and has_signal(*item))
    n = len(rewards)
    out = {
        "reward_mean": fmean(rewards) if rewards else 0.0,
        "reward_std": pstdev(rewards) if rewards else 0.0,
        "reward_mean_sampled": fmean(all_rewards) if all_rewards else 0.0,
        "accuracy": fmean(correct) if correct else 0.0,
        "length_mean": fmean(lengths) if lengths else 0.0,
        "length_max": float(max(lengths)) if lengths else 0.0,
        "truncated_ratio": fmean(truncated) if truncated else 0.0,
        "advantage_abs_mean": fmean(abs(a) for a in advantages) if advantages else 0.0,
        "advantage_max": max(advantages) if advantages else 0.0,
        "advantage_min": min(advantages) if advantages else 0.0,
        "groups": float(sum(1 for k in kept if k is not None)),
        "groups_with_signal": float(with_signal),
        "zero_variance_ratio": (n_prompts - with_signal) / n_prompts if n_prompts else 0.0,
        "gen_tokens": float(tokens),
        "gen_seconds": gen_seconds,
        "tokens_per_s": tokens / gen_seconds if gen_seconds > 0 else 0.0,
    }
    out.update({f"reward/{name}": fmean(values) for name, values in sorted(components.items())})
    out.update({f"status/{name}": count / n for name, count in sorted(statuses.items())})
    return out


def step_samples(
    kept: Sequence[tuple[Group, RewardResult] | None], per_step: int, max_chars: int = 4000
) -> list[dict[str, Any]]:
    """The first trajectory of each of the first ``per_step`` kept groups: what the model wrote, with
    its reward breakdown and verification status (for trackers' text/tables and the run page)."""
    out: list[dict[str, Any]] = []
    for item in kept:
        if len(out) >= per_step:
            break
        if item is None or not item[0].trajectories:
            continue
        group, result = item
        t = group.trajectories[0]
        r = next((x for x in result.rewards if x.trajectory_id == t.id), None)
        out.append(
            {
                "group_id": group.id,
                "trajectory_id": t.id,
                "mode": group.mode,
                "prompt": (group.prompt or "")[:max_chars],
                "response": (t.text or "")[:max_chars],
                "label": group.label,
                "reward": r.total if r else 0.0,
                "components": dict(r.components) if r else {},
                "status": r.status if r else "missing",
                "finish_reason": t.finish_reason,
                "length": len(t.completion_ids),
                "policy_version": t.policy_version,
            }
        )
    return out
