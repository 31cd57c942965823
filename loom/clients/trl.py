"""TRL reward functions that score through Loom's reward service over HTTP.

    from loom.clients.trl import make_reward_func
    trainer = GRPOTrainer(..., reward_funcs=[make_reward_func(components=[{"name": "accuracy"}])])

The returned function has TRL's signature ``(prompts, completions, completion_ids=None, **columns)
-> list[float | None]``: the label comes from the dataset column ``label_column``; completions that
share a prompt form one group (GRPO's ``num_generations`` samples), scored in one HTTP call.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from loom.clients.reward import RewardClient
from loom.schemas import Group, RewardComponent, RewardSpec, Trajectory

RewardFunc = Callable[..., list[float | None]]


def _text(x: Any) -> str:
    """A completion or prompt: a string, or a conversation (list of ``{"role", "content"}``)."""
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in x)
    return str(x)


def make_reward_func(
    url: str | None = None,
    *,
    components: list[dict[str, Any]] | None = None,
    task: str | None = None,
    label_column: str = "answer",
    component: str | None = None,
    timeout_s: float = 180.0,
    retries: int = 4,
    name: str = "loom_reward",
) -> RewardFunc:
    """A TRL reward function. ``component`` returns that component alone instead of the total (to
    give TRL one function per component and weight them with ``reward_weights``)."""
    spec = RewardSpec(
        components=[RewardComponent.model_validate(c) for c in components or [{"name": "accuracy"}]]
    )
    client = RewardClient(url, timeout=timeout_s, retries=retries)

    def reward_func(
        prompts: list[Any], completions: list[Any], completion_ids: Any = None, **columns: Any
    ) -> list[float | None]:
        labels = columns.get(label_column) or [None] * len(completions)
        groups: dict[tuple[str, str | None], Group] = {}
        where: list[tuple[tuple[str, str | None], int]] = []
        for i, (p, c, lab) in enumerate(zip(prompts, completions, labels, strict=True)):
            label = None if lab is None else lab if isinstance(lab, str) else json.dumps(lab)
            key = (_text(p), label)
            if key not in groups:
                gid = f"trl-{len(groups)}"
                groups[key] = Group(id=gid, prompt=key[0], label=label, task=task)  # type: ignore[arg-type]
            g = groups[key]
            g.trajectories.append(Trajectory(id=f"c{i}", group_id=g.id, text=_text(c)))
            where.append((key, len(g.trajectories) - 1))
        keys = list(groups)
        results = dict(zip(keys, client.score([groups[k] for k in keys], spec), strict=True))
        out: list[float | None] = []
        for key, ti in where:
            r = results[key].rewards[ti]
            out.append(r.components.get(component) if component else r.total)
        return out

    reward_func.__name__ = name
    return reward_func
