"""Adaptive sampling (Reinforce-Ada, paper 001 Algorithm 1; docs/algorithms.md §4). Pure logic.

Phase 1 (rounds): every active prompt gets M new responses per round; a prompt leaves the active set
once its exit condition holds (``positive``: >= 1 positive; ``balanced``: >= floor(n/2) positives and
>= n - floor(n/2) negatives); at most R rounds.
Phase 2 (down-sampling): each prompt's pool is cut to the update group size n: min(floor(n/2), #pos)
positives, negatives for the rest, any shortfall filled from the other side (first-come order, or
random). Prompts still active after R rounds fall back to the same rule (the positive variant keeps at
least one positive when any exists); a pool whose rewards are all equal carries no signal under any
estimator and is dropped and counted.
Global statistics: the pool's n, sum and sum of squares (``PoolStats``) travel on the Group, so the
learner's ``global_baseline`` estimator uses the mean of ALL sampled responses (paper eq. in Alg. 1
line 17), not of the kept n.

No HTTP, no Celery: ``run_rounds`` takes a ``sample`` callback that returns the rewards (and any
payload) of M new responses for each active prompt.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from loom.contracts.jobs import AdaptiveParams, ExitRule, FillOrder
from loom.contracts.wire import Group, PoolStats, RewardResult, Trajectory, TrajectoryReward

__all__ = ["AdaptiveParams", "ExitRule", "FillOrder"]  # the contract's, re-exported for the rounds' callers
T = TypeVar("T")


AdaptiveConfig = AdaptiveParams  # the name the benches use (bench/adaptive.py)


def is_positive(reward: float, threshold: float) -> bool:
    return reward > threshold


def exit_met(rewards: Sequence[float], cfg: AdaptiveParams) -> bool:
    """The exit condition on a prompt's pool (paper 001 §2.2, "Exit condition"). A pool smaller than
    n never exits (M < n): it could not fill the update group, so it keeps sampling."""
    if len(rewards) < cfg.n:
        return False
    pos = sum(1 for r in rewards if is_positive(r, cfg.threshold))
    neg = len(rewards) - pos
    if cfg.exit == "positive":
        return pos >= 1
    half = cfg.n // 2
    return pos >= half and neg >= cfg.n - half


def downsample(
    rewards: Sequence[float], cfg: AdaptiveParams, rng: random.Random | None = None
) -> list[int] | None:
    """Indices (into ``rewards``) of the kept update group, or None when the prompt is dropped.

    Fill rule (docs/algorithms.md §4): min(floor(n/2), #pos) positives, then negatives, then any shortfall
    from the other side. Positive variant: at least one positive when any exists. A pool with fewer
    than n responses or with all rewards equal is dropped (it has nothing usable).
    """
    n = cfg.n
    if len(rewards) < n or max(rewards) == min(rewards):
        return None
    pos = [i for i, r in enumerate(rewards) if is_positive(r, cfg.threshold)]
    neg = [i for i, r in enumerate(rewards) if not is_positive(r, cfg.threshold)]
    if cfg.fill == "random":
        rng = rng or random.Random(cfg.seed)
        rng.shuffle(pos)
        rng.shuffle(neg)
    k = min(n // 2, len(pos))
    if cfg.exit == "positive" and pos and k == 0:
        k = 1
    kept = pos[:k] + neg[: n - k]
    if len(kept) < n:  # too few negatives: fill from the positives not yet taken
        kept += pos[k : k + n - len(kept)]
    return sorted(kept)


@dataclass
class Pool(Generic[T]):
    """Everything sampled for one prompt across rounds (first-come order)."""

    rewards: list[float] = field(default_factory=list)
    items: list[T] = field(default_factory=list)
    rounds: int = 0
    exited_round: int | None = None  # None: still active after the last round (fallback)

    def stats(self, threshold: float) -> PoolStats:
        return PoolStats(
            n_sampled=len(self.rewards),
            reward_sum=float(sum(self.rewards)),
            reward_sq_sum=float(sum(r * r for r in self.rewards)),
            n_positive=sum(1 for r in self.rewards if is_positive(r, threshold)),
            rounds=self.rounds,
        )


@dataclass
class AdaptiveCounters:
    prompts: int = 0
    samples: int = 0
    rounds_used: int = 0
    exited: int = 0  # met the exit condition
    fallback: int = 0  # still active after R rounds, down-sampled by the fill rule
    dropped: int = 0  # nothing usable
    exited_per_round: list[int] = field(default_factory=list)

    @property
    def samples_per_prompt(self) -> float:
        return self.samples / self.prompts if self.prompts else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "adaptive_prompts": float(self.prompts),
            "adaptive_samples": float(self.samples),
            "adaptive_samples_per_prompt": self.samples_per_prompt,
            "adaptive_rounds_used": float(self.rounds_used),
            "adaptive_exited": float(self.exited),
            "adaptive_fallback": float(self.fallback),
            "adaptive_dropped": float(self.dropped),
        }


# sample(active prompt indices, round) -> for each of them, M (reward, item) pairs
Sampler = Callable[[list[int], int], list[list[tuple[float, T]]]]


class Rounds(Generic[T]):
    """Phase 1 of Algorithm 1 as steps: while not ``done``, the ``active`` prompts get M new (reward,
    item) pairs each (``add``); ``finish`` gives the pools. The caller samples (``run_rounds`` with a
    callback; the gateway's pipeline awaits its stages between the steps)."""

    def __init__(self, n_prompts: int, cfg: AdaptiveParams) -> None:
        self.cfg = cfg
        self.pools: list[Pool[T]] = [Pool() for _ in range(n_prompts)]
        self.counters = AdaptiveCounters(prompts=n_prompts)
        self.active = list(range(n_prompts))
        self.round = 0

    @property
    def done(self) -> bool:
        return not self.active or self.round >= self.cfg.max_rounds

    def add(self, batches: list[list[tuple[float, T]]]) -> None:
        """This round's batch of every active prompt, in ``active`` order."""
        active, counters, rnd = self.active, self.counters, self.round
        if len(batches) != len(active):
            raise ValueError(f"sampler returned {len(batches)} batches for {len(active)} active prompts")
        still: list[int] = []
        exited = 0
        for idx, batch in zip(active, batches, strict=True):
            pool = self.pools[idx]
            for reward, item in batch:
                pool.rewards.append(float(reward))
                pool.items.append(item)
            pool.rounds += 1
            counters.samples += len(batch)
            if exit_met(pool.rewards, self.cfg):
                pool.exited_round = rnd
                exited += 1
            else:
                still.append(idx)
        counters.rounds_used = rnd + 1
        counters.exited_per_round.append(exited)
        counters.exited += exited
        self.active = still
        self.round += 1

    def finish(self) -> tuple[list[Pool[T]], AdaptiveCounters]:
        self.counters.fallback = len(self.active)
        return self.pools, self.counters


def run_rounds(
    n_prompts: int, sample: Sampler[T], cfg: AdaptiveParams
) -> tuple[list[Pool[T]], AdaptiveCounters]:
    """Phase 1 of Algorithm 1: successive elimination over at most R rounds."""
    rounds: Rounds[T] = Rounds(n_prompts, cfg)
    while not rounds.done:
        rounds.add(sample(rounds.active, rounds.round))
    return rounds.finish()


def select(
    pools: list[Pool[T]], cfg: AdaptiveParams, counters: AdaptiveCounters
) -> list[tuple[int, list[int]] | None]:
    """Phase 2: the kept indices of each pool (None = dropped; counted in ``counters.dropped``)."""
    rng = random.Random(cfg.seed)
    out: list[tuple[int, list[int]] | None] = []
    for i, pool in enumerate(pools):
        kept = downsample(pool.rewards, cfg, rng)
        if kept is None:
            counters.dropped += 1
            out.append(None)
        else:
            out.append((i, kept))
    return out


def uniform_rounds(n_prompts: int, sample: Sampler[T], n: int) -> tuple[list[Pool[T]], AdaptiveCounters]:
    """The GRPO baseline: one round of exactly n responses per prompt, no exit, no down-sampling."""
    cfg = AdaptiveParams(n=n, samples_per_round=n, max_rounds=1)
    return run_rounds(n_prompts, sample, cfg)


# --------------------------------------------------------------------------------------------------
# Groups: merge the per-round groups of one prompt into its update group with pool statistics


def merge_group(
    group_id: str,
    rounds: Sequence[tuple[Group, RewardResult]],
    kept: Sequence[int],
    pool: PoolStats,
) -> tuple[Group, RewardResult]:
    """One Group (id ``group_id``) holding the kept responses of all rounds, with ``pool`` attached.

    ``kept`` indexes the concatenation of every round's trajectories in order.
    """
    trajectories: list[Trajectory] = []
    rewards: list[TrajectoryReward] = []
    for rnd, (group, result) in enumerate(rounds):
        by_id = {r.trajectory_id: r for r in result.rewards}
        for traj in group.trajectories:
            tid = f"{group_id}-r{rnd}-{traj.id}"
            trajectories.append(traj.model_copy(update={"id": tid, "group_id": group_id}))
            rw = by_id.get(traj.id) or TrajectoryReward(trajectory_id=traj.id, total=0.0, status="invalid")
            rewards.append(rw.model_copy(update={"trajectory_id": tid}))
    first = rounds[0][0]
    merged = first.model_copy(
        update={
            "id": group_id,
            "trajectories": [trajectories[i] for i in kept],
            "pool": pool,
            "meta": {**first.meta, "adaptive_rounds": pool.rounds, "adaptive_sampled": pool.n_sampled},
        }
    )
    return merged, RewardResult(group_id=group_id, rewards=[rewards[i] for i in kept])
