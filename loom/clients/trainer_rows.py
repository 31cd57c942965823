"""Which of a Loom group's samples a trainer's rows get: one rule for the four trainer adapters
(docs/interop-rollout.md, "What each mode keeps").

A trainer whose loss treats samples independently asks for ``n`` rows per prompt. A plain or
streaming group has exactly its ``n`` trajectories; a spawn group's rows are its roots (the
children's threads have prompts of their own and are not the trainer's rows); a tree (its leaf
count varies with the branching) starts from ``initial >= n`` responses, so it always has enough
leaves, and ``n`` of them are kept (``pick_leaves``): whole subtrees first (the default), or
spread over the expanded responses (``leaves="spread"``, ``LoomRolloutFunc(leaves=...)``).
Measured with TRL's ``GRPOTrainer`` at 16 x 8 for 120 steps, two seeds each (docs/interop-rollout.md,
"TRL"): the sampled reward rose +0.100 and +0.046 per 100 steps with spread rows, +0.060 and +0.072
with subtree rows; neither rule is ahead, so subtree order stays the default.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from loom.clients.rollouts import RolloutGroup, RolloutSample
from loom.contracts.modes import AGENT_TOOLS, ModeParams
from loom.contracts.wire import Mode

Leaves = Literal["subtree", "spread"]
TREES = ("tree", "agent_tree")  # the modes whose groups are trees (agent_tree: a tree of episodes)


def pick_leaves(group: RolloutGroup, n: int, leaves: Leaves = "subtree") -> list[RolloutSample]:
    """``n`` samples of a tree group. ``spread``: the expanded initial responses' subtrees taken in
    turns (every expanded response, then the first branch of each, then the second, ...), then the
    responses not expanded: a group's rows come from as many initial responses as ``n`` allows, since
    a branch shares its response's prefix and is not an independent draw (where every response was
    expanded and ``n`` is their number, that is the responses alone). ``subtree``: whole
    subtrees first, each expanded response with its branches (in the order the tree grew), then the
    responses not expanded."""
    children: dict[str | None, list[RolloutSample]] = {}
    for s in group.samples:
        children.setdefault(s.trajectory.parent_id, []).append(s)

    def subtree(s: RolloutSample) -> list[RolloutSample]:
        return [s] + [d for c in children.get(s.id, []) for d in subtree(c)]

    roots = children.get(None, [])
    trees = [subtree(r) for r in roots if r.id in children]
    if leaves == "spread":
        ordered = [t[i] for i in range(max(map(len, trees), default=0)) for t in trees if i < len(t)]
    else:
        ordered = [x for t in trees for x in t]
    ordered += [r for r in roots if r.id not in children]
    if len(ordered) < n:
        raise ValueError(f"tree group {group.index} has {len(ordered)} leaves, fewer than {n} rows")
    return ordered[:n]


def trainer_samples(
    group: RolloutGroup, mode: Mode, n: int, *, exact: bool = True, leaves: Leaves = "subtree"
) -> list[RolloutSample]:
    """The ``n`` samples of ``group`` that become the trainer's rows (module docstring). ``exact``:
    a non-tree group must have exactly ``n`` roots (False: at least ``n``, the first ``n`` kept);
    ``leaves``: which of a tree's leaves (``pick_leaves``)."""
    if group.group is None:
        raise ValueError(f"prompt {group.index} came back without a group")
    if mode in TREES:
        return pick_leaves(group, n, leaves)
    roots = [s for s in group.samples if s.trajectory.parent_id is None]
    if len(roots) < n or (exact and len(roots) != n):
        raise ValueError(f"group {group.group.id} has {len(roots)} samples for {n} rows")
    return roots[:n]


def trainer_mode_params(
    mode: Mode, mode_params: ModeParams | Mapping[str, Any] | None, trainer: str
) -> dict[str, Any]:
    """``mode_params`` as a plain dict, refused before any job where ``trainer`` (its name, for the
    message) has no form for them: streaming's ``group_positions`` layout numbers the positions of a
    group's samples across the group, and every trainer numbers each sample's positions 0..L."""
    params = mode_params.model_dump() if isinstance(mode_params, ModeParams) else dict(mode_params or {})
    if mode == "streaming" and params.get("layout") == "group_positions":
        raise ValueError(f"streaming layout 'group_positions' has no {trainer} form (positions run 0..L)")
    return params


def check_tree_initial(mode: Mode, mode_params: Mapping[str, Any], n: int, what: str) -> None:
    """Refuse, before the job, a tree that starts from fewer responses than the ``n`` rows it must
    fill (``what`` names the trainer's own setting of ``n`` in the message)."""
    initial = mode_params.get("initial")
    if mode in TREES and initial is not None and int(initial) < n:
        raise ValueError(f"tree mode_params.initial={initial} < {what}={n}: too few leaves")


# ------------------------------------------------------------------------------------------------
# agent mode at the trainers' seams (docs/interop-rollout.md, "Agent mode at each trainer's seam")


def episode_of(s: RolloutSample) -> dict[str, Any]:
    """An agent sample's episode as the trainers' multi-turn records count it: its policy turns, the
    answers it read (``[start, end)`` in completion offsets, the mode's ``turn`` and ``observation``
    segments: ``responses``, a tool's or an environment's), the tool calls among them, the steps its
    environment took (every turn of an environment's episode is a step, a tool call or not, the last
    one too) and why it ended. A sample of another mode is one turn, no tool call."""
    t = s.trajectory
    turn_segs = [g for g in t.segments if g.kind == "turn"]
    turns = [(g.start, g.end) for g in turn_segs]
    # other modes' observation segments (streaming's sentences, spawn's join blocks) are no tool's
    obs = [g for g in t.segments if g.kind == "observation"] if turns else []
    return {
        "turns": len(turns) or 1,
        "tool_calls": sum("env" not in g.meta for g in obs),
        "env_steps": sum("env_status" in g.meta for g in turn_segs),
        "responses": len(obs),
        "turn_spans": turns or [(0, len(s.completion_ids))],
        "observation_spans": [(g.start, g.end) for g in obs],
        "stop_reason": t.stop_reason,
    }


def follow_window(
    mode: Mode, mode_params: ModeParams | Mapping[str, Any] | None, window: int | None
) -> ModeParams | dict[str, Any] | None:
    """agent mode's ``max_total_tokens`` (policy and observation tokens together) set to the trainer's
    response window where the configuration leaves it unset, so a whole episode fits the window the
    trainer pads and trains (a longer one would be cut there); other modes, or no window, as given."""
    if mode != "agent" or window is None:
        return mode_params if isinstance(mode_params, ModeParams) else dict(mode_params or {})
    if isinstance(mode_params, ModeParams):
        if "max_total_tokens" in mode_params.model_fields_set:
            return mode_params
        return mode_params.model_copy(update={"max_total_tokens": window})
    params = dict(mode_params or {})
    params.setdefault("max_total_tokens", window)
    return params


def loom_tools(tools: Iterable[Any], trainer: str) -> list[str]:
    """The names of a trainer's tools (functions, or objects with a ``name``) where each is one of
    Loom's built-in tools, which Loom runs itself (``loom.contracts.modes.AGENT_TOOLS``; a request
    never carries code). Any other is refused here, before a job: Loom cannot run the trainer's code."""
    names = [t if isinstance(t, str) else str(getattr(t, "name", None) or t.__name__) for t in tools]
    unknown = sorted(set(names) - set(AGENT_TOOLS))
    if unknown:
        raise ValueError(
            f"{trainer}'s tools {unknown} are not Loom's built-in tools {list(AGENT_TOOLS)}: "
            "Loom runs only its own (configure agent mode's mode_params.tools)"
        )
    return list(dict.fromkeys(names))
