"""The batch-level driver: per-token advantages of every group of a ``TrainBatch`` under its
estimator (``learner/estimators/<name>.py``), zero-advantage samples dropped and counted
(docs/algorithms.md §5.1-5.2)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from learner.estimators import TokenAdvantages, assign_group
from loom.batching import next_batch_size
from loom.contracts.estimators import EstimatorParams
from loom.contracts.wire import Group, RewardResult, TrainBatch, TrajectoryReward


@dataclass
class Assigned:
    params: EstimatorParams  # the batch's estimator_params, parsed once for the whole step
    samples: list[TokenAdvantages] = field(default_factory=list)
    n_groups: int = 0
    n_valid_groups: int = 0  # groups with at least one sample of non-zero advantage (B''_m)
    n_dropped: int = 0  # zero-advantage samples dropped from the update

    def metrics(self) -> dict[str, float]:
        """What the advantages left to train on, and the batch size AttnRL eq. 10 asks for next."""
        metrics: dict[str, float] = {
            "groups": float(self.n_groups),
            "valid_groups": float(self.n_valid_groups),
            "dropped_zero_adv": float(self.n_dropped),
            "samples": float(len(self.samples)),
        }
        p = self.params
        if p.batch_size is not None and p.target_groups is not None:
            metrics["next_batch_size"] = float(
                next_batch_size(p.batch_size, p.target_groups, self.n_valid_groups, lam=p.batch_lambda)
            )
        return metrics


def _reward_map(results: Sequence[RewardResult]) -> dict[tuple[str, str], TrajectoryReward]:
    """Rewards by (group id, trajectory id): trajectory ids are unique within a group only (every
    rollout numbers its own ``t0, t1, ...``), so an id alone would give one group another's rewards."""
    return {(res.group_id, r.trajectory_id): r for res in results for r in res.rewards}


def _group_rewards(
    rewards: Mapping[tuple[str, str], TrajectoryReward], group: Group
) -> dict[str, TrajectoryReward]:
    """The rewards of ``group``'s trajectories, by trajectory id."""
    return {t.id: rewards[(group.id, t.id)] for t in group.trajectories if (group.id, t.id) in rewards}


def assign_batch(batch: TrainBatch, *, drop_zero: bool = True) -> Assigned:
    """Per-token advantages of every group; zero-advantage samples dropped and counted."""
    rewards = _reward_map(batch.rewards)
    params = batch.estimator_params  # typed: parsed with the batch
    out = Assigned(params, n_groups=len(batch.groups))
    for g in batch.groups:
        samples = assign_group(g, _group_rewards(rewards, g), batch.estimator, params)
        kept = [s for s in samples if not s.is_zero] if drop_zero else samples
        for s in samples:
            s.group_id = g.id
        out.n_dropped += len(samples) - len(kept)
        if any(not s.is_zero for s in samples):
            out.n_valid_groups += 1
        out.samples.extend(kept)
    return out
