"""Run datasets: Loom's built-in synthetic tasks (loom.tiny.tasks) or uploaded JSONL of {prompt, answer}."""

from __future__ import annotations

import json
import random
from typing import Any

from pydantic import ValidationError

from gateway.models import KNOBS, DatasetSpec, TaskItem

BUILTIN_TASK_KIND = {"arith": "arithmetic", "countdown": "countdown"}


class DatasetError(ValueError):
    pass


def builtin_item(problem: Any, mode: str) -> TaskItem:
    """One synthetic problem as a run item: the tiny model's prompt for ``mode`` and an exact label
    (arithmetic: the value; Countdown: the numbers and target as JSON, as reward_svc expects)."""
    from loom import tiny
    from loom.tiny.traces import stream_sentences

    kind = BUILTIN_TASK_KIND[problem.kind]
    if problem.kind == "countdown":
        label = json.dumps({"numbers": list(problem.numbers), "target": problem.target})
    else:
        label = problem.gold
    mode_params: dict[str, Any] = {}
    if mode == "streaming":
        # the streaming mode reveals " <sentence><EOS>" itself, exactly as tiny.stream_prompt writes it
        prompt = tiny.STREAM_HEADER
        mode_params["sentences"] = stream_sentences(problem)
    elif mode == "spawn":
        prompt = tiny.spawn_prompt(problem)
    else:
        prompt = tiny.plain_prompt(problem)
    return TaskItem(prompt=prompt, label=label, task=kind, mode_params=mode_params)  # type: ignore[arg-type]


def load_dataset(spec: DatasetSpec, mode: str = "plain") -> list[TaskItem]:
    """The run's items. Built-in tasks come formatted for ``mode`` in the tiny model's prompt format."""
    if spec.builtin is not None:
        from loom.tiny.tasks import TINY_KNOBS, make_problems

        # Without knobs, the distribution the built-in tiny model was trained on.
        knobs = KNOBS[spec.builtin].model_validate(spec.knobs).model_dump(exclude_unset=True)
        try:
            problems = make_problems(
                spec.builtin, spec.size, spec.seed, split="train", **(knobs or TINY_KNOBS[spec.builtin])
            )
        except ValueError as exc:  # too few distinct problems for ``size`` under these knobs
            raise DatasetError(str(exc)) from None
        return [builtin_item(p, mode) for p in problems]
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
        try:
            items.append(
                TaskItem(prompt=prompt, label=None if answer is None else str(answer), task=spec.task)
            )
        except ValidationError as exc:
            e = exc.errors()[0]
            raise DatasetError(f"jsonl line {lineno}: {'.'.join(map(str, e['loc']))}: {e['msg']}") from None
    if not items:
        raise DatasetError("the dataset is empty")
    return items


def step_indices(n_items: int, batch_size: int, seed: int, step: int) -> list[int]:
    """The dataset rows of ``step``: a pure function of (seed, step), so a resumed run draws the same."""
    rng = random.Random(f"{seed}:{step}")
    if batch_size <= n_items:
        return rng.sample(range(n_items), batch_size)
    return [rng.randrange(n_items) for _ in range(batch_size)]
