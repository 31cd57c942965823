"""REA-RL's keep rule for revised samples (REA-RL §4.2; docs/algorithms.md §3), over scored groups.

A revision is discarded when the original was correct and the revision is not, and when both are
wrong. The rule reads only contracts, so the two places that apply it share it: the gateway's RL step
(gateway/step.py), which scores a revised group once with the run's reward spec, and the reflect
service's own ``/v1/reflect`` (reflect_svc/revise.py), which scores with ``ReflectParams.reward``.
"""

from __future__ import annotations

from typing import Any

from loom.contracts.wire import Group, RevisionInfo, RewardResult, TrajectoryReward


def is_correct(reward: TrajectoryReward) -> bool:
    if "accuracy" in reward.components:
        return reward.components["accuracy"] >= 0.5
    return reward.total > 0.0


def keep_revision(original_correct: bool, revision_correct: bool) -> tuple[bool, str | None]:
    """REA-RL §4.2: discard when the revision turns a correct answer wrong, and when both are wrong."""
    if not revision_correct:
        return False, "original_correct_revision_wrong" if original_correct else "both_wrong"
    return True, None


def reflect_meta(detector: str, infos: list[RevisionInfo]) -> dict[str, Any]:
    """A group's ``meta["reflect"]`` before the keep rule: what reflection did to each original."""
    return {
        "detector": detector,
        "revisions": {},
        "removed_tokens": 0,
        "info": [info.model_dump(mode="json", exclude_defaults=True) for info in infos],
    }


def is_revision(meta: dict[str, Any], parent_id: str | None) -> bool:
    return parent_id is not None and "revision_of" in meta


def keep_revisions(
    group: Group, result: RewardResult, keep_discarded: bool = False
) -> tuple[Group, RewardResult]:
    """``group`` (originals with their draft revisions after them, as the reflect service assembles
    it) and its rewards with every discarded revision left out (kept, marked ``meta["discarded"]``,
    with ``keep_discarded``); ``meta["reflect"]`` records what was kept. A group without revisions
    comes back as it is."""
    drafts = [t for t in group.trajectories if is_revision(t.meta, t.parent_id)]
    if not drafts:
        return group, result
    by_id = {r.trajectory_id: r for r in result.rewards}
    missing = [t.id for t in group.trajectories if t.id not in by_id]
    if missing:
        raise ValueError(f"no reward for {len(missing)} trajectories: {missing[:3]}")
    meta = dict(group.meta)
    reflect = dict(meta.get("reflect") or {})
    infos = [dict(i) for i in reflect.get("info", [])]
    info_of = {i.get("revision_id"): i for i in infos if i.get("revision_id")}
    kept_ids: dict[str, str] = {}
    removed = 0
    dropped: set[str] = set()
    trajectories = []
    for t in group.trajectories:
        if not is_revision(t.meta, t.parent_id):
            trajectories.append(t)
            continue
        assert t.parent_id is not None
        original_correct, revision_correct = is_correct(by_id[t.parent_id]), is_correct(by_id[t.id])
        kept, reason = keep_revision(original_correct, revision_correct)
        info = info_of.get(t.id, {})
        info.update(original_correct=original_correct, revision_correct=revision_correct)
        if kept:
            info["kept"] = True
            kept_ids[t.id] = t.parent_id
            removed += int(t.meta.get("removed_tokens", 0))
            trajectories.append(t)
            continue
        info["discard_reason"] = reason
        if keep_discarded:
            trajectories.append(t.model_copy(update={"meta": {**t.meta, "discarded": reason}}))
        else:
            dropped.add(t.id)
    reflect.update(revisions=kept_ids, removed_tokens=removed, info=infos)
    meta["reflect"] = reflect
    out = group.model_copy(update={"trajectories": trajectories, "meta": meta})
    rewards = result.model_copy(
        update={"rewards": [r for r in result.rewards if r.trajectory_id not in dropped]}
    )
    return out, rewards
