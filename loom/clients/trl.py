"""TRL reward functions that score through Loom's reward service over HTTP.

    from loom.clients.trl import make_reward_func
    trainer = GRPOTrainer(..., reward_funcs=[make_reward_func(components=[{"name": "accuracy"}])])

The returned function has TRL's signature ``(prompts, completions, completion_ids=None, **columns)
-> list[float | None]``: the label comes from the dataset column ``label_column``; completions that
share a prompt form one group (GRPO's ``num_generations`` samples), scored in one HTTP call. Where
TRL passes ``log_metric`` (trl >= 1.x), each component's batch mean and the share of items scored
with status ``ok`` are logged as ``loom/<name>`` beside TRL's own metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loom.clients.reward import RewardClient
from loom.contracts.wire import Group, RewardComponent, RewardSpec, Trajectory
from loom.interop import LabelError, label_text, message_text

RewardFunc = Callable[..., list[float | None]]

# what TRL's GRPOTrainer passes besides the dataset's columns (trl/trainer/grpo_trainer.py)
_TRAINER_KWARGS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})


class MissingLabelColumn(LookupError):
    """The dataset has no column named ``label_column``: scoring would give every completion 0."""


def make_reward_func(
    url: str | None = None,
    *,
    components: list[dict[str, Any]] | None = None,
    task: str | None = None,
    label_column: str | None = "answer",
    component: str | None = None,
    timeout_s: float = 180.0,
    retries: int = 4,
    name: str = "loom_reward",
) -> RewardFunc:
    """A TRL reward function. ``component`` returns that component alone instead of the total (to
    give TRL one function per component and weight them with ``reward_weights``).

    ``label_column`` names the dataset column holding the gold answer (a string, number, dict or list:
    ``loom.interop.label_text``). A dataset without that column raises ``MissingLabelColumn`` naming
    the columns it has, at the first call; ``label_column=None`` scores without labels (for
    components that need none, such as ``format_think``)."""
    spec = RewardSpec(
        components=[RewardComponent.model_validate(c) for c in components or [{"name": "accuracy"}]]
    )
    client = RewardClient(url, timeout=timeout_s, retries=retries)

    def reward_func(
        prompts: list[Any], completions: list[Any], completion_ids: Any = None, **columns: Any
    ) -> list[float | None]:
        if label_column is None:
            labels: list[Any] = [None] * len(completions)
        elif label_column in columns:
            labels = list(columns[label_column])
        else:
            have = sorted(k for k in columns if k not in _TRAINER_KWARGS)
            raise MissingLabelColumn(
                f"{name}: the dataset has no label column {label_column!r} (its columns: {have}); every "
                f"completion would score 0. Pass make_reward_func(label_column=<the gold answer's column>), "
                f"or label_column=None for components that need no label."
            )
        groups: dict[tuple[str, str | None], Group] = {}
        where: list[tuple[tuple[str, str | None], int] | None] = []
        for i, (p, c, raw) in enumerate(zip(prompts, completions, labels, strict=True)):
            try:
                label = label_text(raw)
            except LabelError:
                where.append(None)  # a label no component can read: reward 0, the rest score
                continue
            key = (message_text(p), label)
            if key not in groups:
                groups[key] = Group(id=f"trl-{len(groups)}", prompt=key[0], label=label, task=task)  # type: ignore[arg-type]
            g = groups[key]
            g.trajectories.append(Trajectory(id=f"c{i}", group_id=g.id, text=message_text(c)))
            where.append((key, len(g.trajectories) - 1))
        keys = list(groups)
        results = dict(zip(keys, client.score([groups[k] for k in keys], spec) if keys else [], strict=True))
        rows = [None if w is None else results[w[0]].rewards[w[1]] for w in where]
        out: list[float | None] = [
            0.0 if r is None else r.components.get(component) if component else r.total for r in rows
        ]
        log_metric = columns.get("log_metric")
        if callable(log_metric) and rows:
            for comp in spec.components:
                values = [0.0 if r is None else r.components[comp.name] for r in rows]
                log_metric(f"loom/{comp.name}", sum(values) / len(rows))
            log_metric("loom/status_ok", sum(r is not None and r.status == "ok" for r in rows) / len(rows))
        return out

    reward_func.__name__ = name
    return reward_func
