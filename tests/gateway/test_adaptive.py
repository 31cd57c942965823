"""Reinforce-Ada rules of docs/algorithms.md §4 (gateway/adaptive.py), on hand-made reward lists."""

from __future__ import annotations

import random

import pytest

from gateway.adaptive import AdaptiveParams, downsample, exit_met, merge_group, run_rounds, select
from loom.contracts.wire import Group, RewardResult, Trajectory, TrajectoryReward

POS, NEG = 1.0, 0.0


def test_positive_exit_needs_one_positive() -> None:
    cfg = AdaptiveParams(n=4, exit="positive")
    assert not exit_met([NEG] * 8, cfg)
    assert exit_met([NEG] * 7 + [POS], cfg)


def test_balanced_exit_needs_both_classes() -> None:
    cfg = AdaptiveParams(n=4, exit="balanced")
    assert not exit_met([POS] * 8, cfg)  # all positive: no negatives
    assert not exit_met([POS] + [NEG] * 7, cfg)  # 1 < floor(4/2) positives
    assert exit_met([POS, POS] + [NEG] * 2, cfg)


def test_balanced_exit_odd_n_needs_ceil_negatives() -> None:
    cfg = AdaptiveParams(n=5, exit="balanced")  # floor(5/2)=2 positives, 5-2=3 negatives
    assert not exit_met([POS, POS, POS, NEG, NEG], cfg)
    assert exit_met([POS, POS, NEG, NEG, NEG], cfg)


def test_threshold_is_strict() -> None:
    cfg = AdaptiveParams(n=2, exit="positive", threshold=0.7)
    assert not exit_met([0.7, 0.7], cfg)
    assert exit_met([0.71, 0.7], cfg)


def test_a_pool_smaller_than_n_keeps_sampling_instead_of_being_dropped() -> None:
    # M = 2 < n = 4: one positive in round 0 met the positive exit with 2 responses, and down-sampling
    # then dropped the prompt for having fewer than n
    cfg = AdaptiveParams(n=4, samples_per_round=2, max_rounds=3, exit="positive")
    assert not exit_met([POS, NEG], cfg)
    pools, counters = run_rounds(1, lambda active, rnd: [[(r, r) for r in (POS, NEG)] for _ in active], cfg)
    assert pools[0].rounds == 2 and pools[0].exited_round == 1
    chosen = select(pools, cfg, counters)
    assert chosen[0] is not None and counters.dropped == 0
    with pytest.raises(ValueError, match="can never fill"):
        AdaptiveParams(n=4, samples_per_round=1, max_rounds=3)


def test_downsample_takes_half_positives_first_come() -> None:
    cfg = AdaptiveParams(n=4)
    rewards = [POS, NEG, POS, POS, NEG, NEG, POS, NEG]
    assert downsample(rewards, cfg) == [0, 1, 2, 4]  # positives 0,2 ; negatives 1,4


def test_downsample_fills_shortfall_from_the_other_side() -> None:
    cfg = AdaptiveParams(n=4)
    # one negative only: 2 positives + 1 negative, then 1 more positive
    assert downsample([POS, POS, POS, NEG, POS], cfg) == [0, 1, 2, 3]
    # one positive only: 1 positive + 3 negatives
    assert downsample([NEG, NEG, NEG, NEG, POS, NEG], cfg) == [0, 1, 2, 4]


def test_downsample_random_fill_keeps_the_class_counts() -> None:
    cfg = AdaptiveParams(n=4, fill="random", seed=3)
    rewards = [POS] * 6 + [NEG] * 6
    kept = downsample(rewards, cfg, random.Random(3))
    assert kept is not None and len(kept) == 4
    assert sum(1 for i in kept if rewards[i] == POS) == 2


def test_positive_variant_keeps_a_positive_even_when_n_is_one() -> None:
    assert downsample([NEG, NEG, POS], AdaptiveParams(n=1, exit="positive")) == [2]
    assert downsample([NEG, NEG, POS], AdaptiveParams(n=1, exit="balanced")) == [0]


def test_pool_without_signal_is_dropped() -> None:
    cfg = AdaptiveParams(n=4)
    assert downsample([NEG] * 32, cfg) is None  # never a positive
    assert downsample([POS] * 32, cfg) is None  # never a negative
    assert downsample([POS, NEG], cfg) is None  # fewer than n responses


def _sampler(pass_rates: dict[int, list[float]]):
    """Scripted rewards: prompt i returns the next M values of its list each round."""
    cursor = {i: 0 for i in pass_rates}
    calls: list[tuple[list[int], int]] = []

    def sample(active: list[int], rnd: int) -> list[list[tuple[float, tuple[int, int]]]]:
        calls.append((list(active), rnd))
        out = []
        for i in active:
            vals = pass_rates[i][cursor[i] : cursor[i] + 4]
            cursor[i] += 4
            out.append([(v, (i, rnd)) for v in vals])
        return out

    return sample, calls


def test_rounds_deactivate_exited_prompts_and_fall_back_after_R() -> None:
    cfg = AdaptiveParams(n=4, samples_per_round=4, max_rounds=3, exit="balanced")
    script = {
        0: [POS, NEG, POS, NEG] * 3,  # exits in round 0
        1: [NEG, NEG, NEG, NEG, POS, NEG, NEG, NEG, POS, NEG, NEG, NEG],  # 2 positives by round 2
        2: [NEG] * 12,  # never a positive: dropped
        3: [NEG, NEG, NEG, NEG, NEG, NEG, NEG, POS, NEG, NEG, NEG, NEG],  # 1 positive: fallback fill
    }
    sample, calls = _sampler(script)
    pools, counters = run_rounds(4, sample, cfg)
    assert calls == [([0, 1, 2, 3], 0), ([1, 2, 3], 1), ([1, 2, 3], 2)]
    assert [p.exited_round for p in pools] == [0, 2, None, None]
    assert counters.samples == 4 + 12 + 12 + 12 and counters.rounds_used == 3
    assert counters.exited == 2 and counters.fallback == 2 and counters.exited_per_round == [1, 0, 1]
    chosen = select(pools, cfg, counters)
    assert chosen[2] is None and counters.dropped == 1
    assert chosen[3] is not None and [pools[3].rewards[i] for i in chosen[3][1]] == [NEG, NEG, NEG, POS]
    assert counters.samples_per_prompt == pytest.approx(40 / 4)


def test_pool_stats_cover_every_sampled_response() -> None:
    cfg = AdaptiveParams(n=2, samples_per_round=4, max_rounds=2, exit="balanced")
    sample, _ = _sampler({0: [NEG, NEG, NEG, NEG, POS, 0.5, NEG, NEG]})
    pools, _ = run_rounds(1, sample, cfg)
    stats = pools[0].stats(cfg.threshold)
    assert (stats.n_sampled, stats.reward_sum, stats.n_positive, stats.rounds) == (8, 1.5, 1, 2)
    assert stats.reward_sq_sum == pytest.approx(1.25)


def test_merge_group_keeps_selected_trajectories_with_unique_ids_and_pool() -> None:
    def round_group(gid: str, rewards: list[float]) -> tuple[Group, RewardResult]:
        trajs = [Trajectory(id=f"t{i}", group_id=gid, completion_ids=[i]) for i in range(len(rewards))]
        rws = [TrajectoryReward(trajectory_id=f"t{i}", total=r) for i, r in enumerate(rewards)]
        return Group(id=gid, trajectories=trajs), RewardResult(group_id=gid, rewards=rws)

    rounds = [round_group("x.r0", [NEG, NEG]), round_group("x.r1", [POS, NEG])]
    cfg = AdaptiveParams(n=2)
    kept = downsample([NEG, NEG, POS, NEG], cfg)
    assert kept == [0, 2]
    sample, _ = _sampler({0: [NEG, NEG, POS, NEG]})
    pools, _ = run_rounds(1, sample, AdaptiveParams(n=2, samples_per_round=4, max_rounds=1))
    group, result = merge_group("x", rounds, kept, pools[0].stats(0.7))
    assert group.id == "x" and all(t.group_id == "x" for t in group.trajectories)
    assert [t.id for t in group.trajectories] == ["x-r0-t0", "x-r1-t0"]
    assert [r.total for r in result.rewards] == [NEG, POS]
    assert [r.trajectory_id for r in result.rewards] == [t.id for t in group.trajectories]
    assert group.pool is not None and group.pool.n_sampled == 4
