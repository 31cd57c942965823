"""What the run page shows of a scored group, as plain data for the templates. Pure.

A group is a ``ScoredGroup`` payload (``{"index", "group", "rewards"}``, the shape ``/v1/jobs/{id}``
answers) or a run's stored sample (``{"step", "idx", "group_id", "group", "rewards"}``,
RunStore.samples; ``idx`` is its index). Trees (``Group.tree``: TreeNode parents and completion-token
spans; rollout_svc/modes/tree.py) become nested nodes with their node value (the mean reward of the
trajectories through the node, TreeRL's V(n): docs/algorithms.md §2.3) and, for the first node of a
branch, its branch point and the score that chose it; spawn groups (``Group.threads``: ThreadLink
parent -> child) become a forest of calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

# the segment kinds the page colours (loom/contracts/wire.py SegmentKind); tree_node spans are drawn
# by the tree view instead
SHOWN_SEGMENTS = ("prompt", "observation", "stream", "deep", "answer", "thread", "revision")


@dataclass
class Bar:
    """One coloured span of a completion, in percent of its length."""

    kind: str
    left: float
    width: float
    label: str


@dataclass
class TrajectoryView:
    id: str
    text: str
    n_tokens: int
    total: float | None
    components: dict[str, float]
    status: str
    finish_reason: str
    parent_id: str | None
    meta: dict[str, Any]
    bars: list[Bar]
    revision_of: str | None
    truncated: bool  # a reflection revision: the original was cut and given a forced ending


@dataclass
class NodeView:
    id: str
    trajectory_id: str
    start: int
    end: int
    value: float | None
    n_leaves: int
    branch_point: int | None = None
    strategy: str | None = None
    score: str | None = None  # "-log p 2.31" (entropy) or "FCI max 0.42" (attention)
    children: list[NodeView] = field(default_factory=list)


@dataclass
class CallView:
    id: str
    depth: int
    status: str
    message: str
    total: float | None
    text: str
    n_tokens: int
    bars: list[Bar]
    children: list[CallView] = field(default_factory=list)


@dataclass
class GroupView:
    index: int
    id: str
    mode: str
    prompt: str
    label: str | None
    dropped: bool
    trajectories: list[TrajectoryView]
    tree: list[NodeView]
    forest: list[CallView]
    meta: dict[str, Any]


def _bars(segments: list[dict[str, Any]], n_tokens: int) -> list[Bar]:
    if n_tokens <= 0:
        return []
    out = []
    for s in segments:
        if s.get("kind") not in SHOWN_SEGMENTS:
            continue
        a, b = int(s.get("start", 0)), int(s.get("end", 0))
        label = f"{s['kind']} {s.get('index', 0)}: tokens {a}-{b}"
        out.append(Bar(s["kind"], 100.0 * a / n_tokens, max(100.0 * (b - a) / n_tokens, 0.4), label))
    return out


def _rewards(payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rewards = payload.get("rewards") or {}
    return {r["trajectory_id"]: r for r in rewards.get("rewards", [])}


def trajectory_views(payload: dict[str, Any]) -> list[TrajectoryView]:
    group = payload.get("group") or {}
    by_id = _rewards(payload)
    out = []
    for t in group.get("trajectories", []):
        r = by_id.get(t["id"], {})
        n = len(t.get("completion_ids", []))
        meta = t.get("meta", {})
        out.append(
            TrajectoryView(
                id=t["id"],
                text=t.get("text") or "",
                n_tokens=n,
                total=r.get("total"),
                components=r.get("components", {}),
                status=r.get("status", "unscored"),
                finish_reason=t.get("finish_reason", ""),
                parent_id=t.get("parent_id"),
                meta=meta,
                bars=_bars(t.get("segments", []), n),
                revision_of=meta.get("revision_of"),
                truncated="revision_of" in meta
                or any(s.get("kind") == "revision" for s in t.get("segments", [])),
            )
        )
    return out


def _branch_score(t: dict[str, Any], parent: dict[str, Any] | None, group_meta: dict[str, Any]) -> str | None:
    """The score that chose this branch: the parent token's -log-prob at the branch point (entropy
    strategy, TreeRL) or the FCI of the step it starts (attention, AttnRL eq. 6; groups made before
    trajectories recorded it show the parent path's highest step FCI)."""
    meta = t.get("meta", {})
    strategy, b = meta.get("strategy"), meta.get("branch_point")
    if parent is None or b is None:
        return None
    if strategy == "entropy":
        lp = parent.get("logprobs") or []
        if 0 <= b < len(lp) and lp[b] is not None and math.isfinite(lp[b]):
            return f"-log p {-lp[b]:.3f}"
        return None
    if strategy == "attention":
        at = meta.get("branch_fci")
        if isinstance(at, int | float) and math.isfinite(at):
            return f"FCI {at:.3f}"
        fci = (group_meta.get("fci") or {}).get(parent["id"])
        if fci:
            return "FCI max " + f"{max(fci):.3f}"
    return None


def tree_view(payload: dict[str, Any]) -> list[NodeView]:
    """The tree's root nodes, each with its children (empty when the group has no tree)."""
    group = payload.get("group") or {}
    nodes = group.get("tree") or []
    if not nodes:
        return []
    by_traj = {t["id"]: t for t in group.get("trajectories", [])}
    totals = {k: r.get("total") for k, r in _rewards(payload).items()}
    # the trajectories through each node: its tree_node segments name them (tree.py _node_segments)
    through: dict[str, list[float]] = {}
    for t in group.get("trajectories", []):
        total = totals.get(t["id"])
        for s in t.get("segments", []):
            node = (s.get("meta") or {}).get("node")
            if s.get("kind") == "tree_node" and node and total is not None:
                through.setdefault(node, []).append(float(total))
    views: dict[str, NodeView] = {}
    for n in nodes:
        values = through.get(n["id"], [])
        views[n["id"]] = NodeView(
            id=n["id"],
            trajectory_id=n["trajectory_id"],
            start=n["start"],
            end=n["end"],
            value=fmean(values) if values else None,
            n_leaves=len(values),
        )
    roots = []
    for n in nodes:
        view = views[n["id"]]
        parent = n.get("parent")
        t = by_traj.get(n["trajectory_id"], {})
        if parent is not None and n["id"].endswith(":0") and "branch_point" in t.get("meta", {}):
            view.branch_point = t["meta"]["branch_point"]
            view.strategy = t["meta"].get("strategy")
            view.score = _branch_score(t, by_traj.get(t.get("parent_id") or ""), group.get("meta", {}))
        if parent is None or parent not in views:
            roots.append(view)
        else:
            views[parent].children.append(view)
    return roots


def forest_view(payload: dict[str, Any]) -> list[CallView]:
    """The spawn/join forest: one root call per rollout, children by their ThreadLinks."""
    group = payload.get("group") or {}
    links = group.get("threads") or []
    trajectories = group.get("trajectories", [])
    if not links and group.get("mode") != "spawn":
        return []
    totals = {k: r.get("total") for k, r in _rewards(payload).items()}
    message = {link["child"]: link.get("message", "") for link in links}
    views: dict[str, CallView] = {}
    for t in trajectories:
        n = len(t.get("completion_ids", []))
        views[t["id"]] = CallView(
            id=t["id"],
            depth=int(t.get("meta", {}).get("depth", 0)),
            status=str(t.get("meta", {}).get("status", "")),
            message=message.get(t["id"], ""),
            total=totals.get(t["id"]),
            text=t.get("text") or "",
            n_tokens=n,
            bars=_bars(t.get("segments", []), n),
        )
    children = {link["child"] for link in links}
    for link in links:
        if link["parent"] in views and link["child"] in views:
            views[link["parent"]].children.append(views[link["child"]])
    return [v for k, v in views.items() if k not in children]


def group_view(payload: dict[str, Any]) -> GroupView:
    group = payload.get("group") or {}
    return GroupView(
        index=int(payload["index"] if "index" in payload else payload.get("idx", 0)),
        id=group.get("id", ""),
        mode=group.get("mode", ""),
        prompt=group.get("prompt") or "",
        label=group.get("label"),
        dropped=payload.get("group") is None,
        trajectories=trajectory_views(payload),
        tree=tree_view(payload),
        forest=forest_view(payload),
        meta={k: v for k, v in group.get("meta", {}).items() if not isinstance(v, (dict, list))},
    )
