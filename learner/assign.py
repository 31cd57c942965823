"""Per-token advantages from a group's rewards and its trajectories' segments (ALGORITHMS.md 5.1-5.2).

Token conventions (completion-token offsets, aligned with ``completion_ids``):
- trained tokens: ``loss_mask`` (default all 1) AND not inside an ``observation`` segment;
  observation tokens are never trained by any estimator or loss term;
- HRPO streaming phase: trained tokens inside ``stream`` segments (|t_s| of AdaSR eq. 4-5);
  deep phase: every other trained token (deep reasoning and answer, the interval (|t_s|, |o|]);
- TreeRL: tokens inside a tree node's [start, end) get that node's advantage; a node of another
  trajectory applies where this trajectory's completion repeats the node's tokens at the same
  offsets (a branch copies its prefix); uncovered trained tokens get the trajectory's leaf advantage.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from learner import advantages as est
from loom.schemas import Estimator, Group, RewardResult, TrainBatch, Trajectory, TrajectoryReward


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


@dataclass
class Assigned:
    samples: list[TokenAdvantages] = field(default_factory=list)
    n_groups: int = 0
    n_valid_groups: int = 0  # groups with at least one sample of non-zero advantage (B''_m)
    n_dropped: int = 0  # zero-advantage samples dropped from the update


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


def _reward_map(results: Sequence[RewardResult]) -> dict[tuple[str, str], TrajectoryReward]:
    """Rewards by (group id, trajectory id): trajectory ids are unique within a group only (every
    rollout numbers its own ``t0, t1, ...``), so an id alone would give one group another's rewards."""
    return {(res.group_id, r.trajectory_id): r for res in results for r in res.rewards}


def _group_rewards(
    rewards: Mapping[tuple[str, str], TrajectoryReward], group: Group
) -> dict[str, TrajectoryReward]:
    """The rewards of ``group``'s trajectories, by trajectory id."""
    return {t.id: rewards[(group.id, t.id)] for t in group.trajectories if (group.id, t.id) in rewards}


def _value(r: TrajectoryReward, key: str | None) -> float:
    if key is None or key == "total":
        return float(r.total)
    if key not in r.components:
        raise ValueError(f"reward of trajectory {r.trajectory_id} has no component {key!r}")
    return float(r.components[key])


def _need(rewards: Mapping[str, TrajectoryReward], t: Trajectory) -> TrajectoryReward:
    if t.id not in rewards:
        raise ValueError(f"trajectory {t.id} of group {t.group_id} has no reward")
    return rewards[t.id]


def _uniform(t: Trajectory, a: float, mask: list[int]) -> list[float]:
    return [a if m else 0.0 for m in mask]


def _forest_root(t: Trajectory, parent_of: Mapping[str, str | None]) -> str:
    cur, seen = t.id, set()
    while parent_of.get(cur) is not None and cur not in seen:
        seen.add(cur)
        cur = parent_of[cur]  # type: ignore[assignment]
    return cur


def assign_group(
    group: Group, rewards: Mapping[str, TrajectoryReward], estimator: Estimator, params: Mapping[str, Any]
) -> list[TokenAdvantages]:
    """Per-token advantages of one group under ``estimator`` (``params``: estimator_params)."""
    eps = float(params.get("eps", est.EPS))
    key = params.get("reward_key")
    trajs = group.trajectories
    masks = [trained_mask(t) for t in trajs]

    if estimator in ("grpo", "dr_grpo", "rea", "global_baseline"):
        r = [_value(_need(rewards, t), key) for t in trajs]
        if estimator == "grpo":
            a = est.grpo(r, eps=eps)
        elif estimator == "dr_grpo":
            a = est.dr_grpo(r)
        elif estimator == "rea":
            a = est.rea(r, eps=eps)
        else:
            if group.pool is not None and key not in (None, "total"):
                # the pool's sums are of the total reward (what adaptive sampling ranks by): mixing
                # them with another component's r_i would centre on the wrong mean
                raise ValueError(
                    f"group {group.id}: global_baseline's pool statistics are of the total reward, "
                    f"so estimator_params.reward_key must be 'total' (got {key!r})"
                )
            a = est.global_baseline(r, group.pool, std=bool(params.get("std", False)), eps=eps)
        return [TokenAdvantages(t, _uniform(t, ai, m), m) for t, ai, m in zip(trajs, a, masks, strict=True)]

    if estimator == "hrpo":
        names = est.HrpoNames(**{k: v for k, v in (params.get("names") or {}).items()})
        comps = [_need(rewards, t).components for t in trajs]
        h = est.hrpo(
            comps,
            beta=float(params.get("beta", 0.05)),
            w_acc=float(params.get("w_acc", 1.0)),
            w_fmt=float(params.get("w_fmt", 2.0)),
            mask_length_by_format=bool(params.get("mask_length_by_format", True)),
            names=names,
            eps=eps,
        )
        out = []
        for t, hi, m in zip(trajs, h, masks, strict=True):
            stream = [s & mm for s, mm in zip(kind_mask(t, "stream"), m, strict=True)]
            deep = [mm and not s for s, mm in zip(stream, m, strict=True)]
            out.append(
                TokenAdvantages(
                    t,
                    _uniform(t, hi.adv_global, m),
                    m,
                    adv_stream=[hi.adv_stream if s else 0.0 for s in stream],
                    adv_deep=[hi.adv_deep if d else 0.0 for d in deep],
                    stream_mask=stream,
                )
            )
        return out

    if estimator == "apr":
        parent_of: dict[str, str | None] = {t.id: t.parent_id for t in trajs}
        for link in group.threads or []:
            parent_of[link.child] = link.parent
        root_of = {t.id: _forest_root(t, parent_of) for t in trajs}
        roots = [t for t in trajs if root_of[t.id] == t.id]
        calls = {r.id: sum(1 for t in trajs if root_of[t.id] == r.id) for r in roots}
        root_rewards = [_value(_need(rewards, r), key) for r in roots]
        adv_w = est.apr(root_rewards, [calls[r.id] for r in roots], eps=eps)
        by_root = {r.id: aw for r, aw in zip(roots, adv_w, strict=True)}
        return [
            TokenAdvantages(t, _uniform(t, by_root[root_of[t.id]][0], m), m, weight=by_root[root_of[t.id]][1])
            for t, m in zip(trajs, masks, strict=True)
        ]

    if estimator == "treerl":
        if not group.tree:
            raise ValueError(f"group {group.id}: estimator treerl needs the group's tree")
        vkey = key or "accuracy"
        leaf_values = {}
        for t in trajs:
            tr = _need(rewards, t)
            leaf_values[t.id] = float(tr.components.get(vkey, tr.total))
        node_adv = est.treerl(group.tree, leaf_values)
        by_traj = {t.id: t for t in trajs}
        by_id = {n.id: n for n in group.tree}
        out = []
        for t, m in zip(trajs, masks, strict=True):
            own = [n for n in group.tree if n.trajectory_id == t.id]
            adv = [0.0] * len(m)
            covered = [0] * len(m)
            leaf = None
            if own:
                leaf = max(own, key=lambda n: _depth(n.id, by_id))
            path = []
            cur = leaf.id if leaf else None
            while cur is not None:
                path.append(by_id[cur])
                cur = by_id[cur].parent
            for node in path:
                owner = by_traj.get(node.trajectory_id)
                if node.end > len(m) or owner is None:
                    continue
                if (
                    owner is not t
                    and owner.completion_ids[node.start : node.end] != t.completion_ids[node.start : node.end]
                ):
                    continue  # the prefix lives in this trajectory's prompt, not its completion
                for j in range(node.start, node.end):
                    if not covered[j]:
                        adv[j] = node_adv[node.id]
                        covered[j] = 1
            fill = node_adv[leaf.id] if leaf else 0.0
            adv = [(a if c else fill) if mm else 0.0 for a, c, mm in zip(adv, covered, m, strict=True)]
            out.append(TokenAdvantages(t, adv, m))
        return out

    raise ValueError(f"unknown estimator {estimator!r}")


def _depth(nid: str, by_id: Mapping[str, Any]) -> int:
    d, cur = 0, nid
    while cur is not None and d <= len(by_id):
        cur = by_id[cur].parent
        d += 1
    return d


def assign_batch(batch: TrainBatch, *, drop_zero: bool = True) -> Assigned:
    """Per-token advantages of every group; zero-advantage samples dropped and counted."""
    rewards = _reward_map(batch.rewards)
    out = Assigned(n_groups=len(batch.groups))
    for g in batch.groups:
        samples = assign_group(g, _group_rewards(rewards, g), batch.estimator, batch.estimator_params)
        kept = [s for s in samples if not s.is_zero] if drop_zero else samples
        for s in samples:
            s.group_id = g.id
        out.n_dropped += len(samples) - len(kept)
        if any(not s.is_zero for s in samples):
            out.n_valid_groups += 1
        out.samples.extend(kept)
    return out
