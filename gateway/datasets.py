"""Run datasets: Loom's built-in synthetic tasks (loom.tiny.tasks) or uploaded JSONL of {prompt, answer}."""

from __future__ import annotations

import json
import random

from gateway.models import DatasetSpec, TaskItem

BUILTIN_TASK_KIND = {"arith": "arithmetic", "countdown": "countdown"}


class DatasetError(ValueError):
    pass


def load_dataset(spec: DatasetSpec) -> list[TaskItem]:
    if spec.builtin is not None:
        from loom.tiny.tasks import make_problems

        problems = make_problems(spec.builtin, spec.size, spec.seed, split="train", **spec.knobs)
        kind = BUILTIN_TASK_KIND[spec.builtin]
        return [TaskItem(prompt=p.text, label=p.gold, task=kind) for p in problems]  # type: ignore[arg-type]
    items: list[TaskItem] = []
    for lineno, line in enumerate((spec.jsonl or "").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, answer = row["prompt"], row.get("answer")
        except (ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"jsonl line {lineno}: expected an object with 'prompt' and 'answer'") from exc
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"jsonl line {lineno}: 'prompt' must be a non-empty string")
        items.append(TaskItem(prompt=prompt, label=None if answer is None else str(answer), task=spec.task))
    if not items:
        raise DatasetError("the dataset is empty")
    return items


def step_indices(n_items: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The dataset rows of ``step``: a pure function of (seed, step), so a resumed run draws the same."""
    rng = random.Random(f"{seed}:{step}")
    if batch_size <= n_items:
        return rng.sample(range(n_items), batch_size)
    return [rng.randrange(n_items) for _ in range(batch_size)]
