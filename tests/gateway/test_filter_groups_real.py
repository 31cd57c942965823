"""A run with ``filter_groups`` (DAPO's dynamic sampling, docs/algorithms.md §5.3) on the REAL services:
``loom worker rollout`` (torch engine, tiny model), ``loom worker reward`` and ``loom worker learner``.
The reward is accuracy + a length term, so a group whose accuracy is the same for every response
still has a non-zero summed-reward advantage and would be trained without the filter; with
``filter_groups: accuracy`` each step trains exactly the groups whose accuracy differs, a step with
none trains nothing, and the policy version moves only on the steps that trained. With
``filter_max_batches`` 2 a step whose first batch has too few such groups draws a second batch."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.state import GatewayState
from zoo.tiny.tasks import make_problems
from zoo.tiny.traces import plain_prompt

sys.path.insert(0, str(Path(__file__).parent))
from helpers import RUNS_KEY, real_services, start_run, trained_steps, wait_run_succeeded  # noqa: E402

STEPS = 3


def _dataset() -> str:
    """Arithmetic the tiny model solves some of the time, and the same prompts with a label no answer
    matches (their accuracy is 0 for every response: a uniform group in every step that draws one)."""
    rows = []
    for p in make_problems("arith", 6, seed=11):
        rows.append({"prompt": plain_prompt(p), "answer": p.gold})
        rows.append({"prompt": plain_prompt(p), "answer": "no number is this"})
    return "".join(json.dumps(r) + "\n" for r in rows)


RUN = {
    "run_key": "filter-real",
    "dataset": {"jsonl": _dataset()},
    "sampling": {"n": 4, "max_tokens": 32, "temperature": 1.3},
    "reward": {"components": [{"name": "accuracy", "weight": 1.0}, {"name": "length_kimi", "weight": 0.5}]},
    "filter_groups": "accuracy",
    "estimator": "grpo",
    "loss": {"lr": 1e-4},
}


def _differs(sample: dict[str, Any], component: str) -> bool:
    return len({r["components"].get(component, 0.0) for r in sample["rewards"]["rewards"]}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
@pytest.mark.parametrize("batch,max_batches", [(4, 1), (2, 2)])  # batch x max_batches <= SAMPLE_GROUPS
def test_a_filtered_run_trains_exactly_the_groups_whose_accuracy_differs(
    broker_env: Any, loom_worker: Callable[..., Any], tmp_path: Path, batch: int, max_batches: int
) -> None:
    """Every group a step generates is stored (gateway.runs.SAMPLE_GROUPS = 4) and checked."""
    run = {
        **RUN,
        "run_key": f"filter-{batch}-{max_batches}",
        "filter_max_batches": max_batches,
        "schedule": {"steps": STEPS, "batch_size": batch, "staleness": 0},
    }
    with real_services(broker_env, loom_worker, tmp_path) as gw:
        run_id = start_run(gw, run)
        view = wait_run_succeeded(gw, run_id, 300)
        metrics = gw.get(f"/v1/runs/{run_id}/metrics", RUNS_KEY).json()

    samples = GatewayState(tmp_path / "loom-data" / "gateway.sqlite").runs.samples(run_id)
    uniform_with_signal = 0
    for m in metrics:
        groups = [s for s in samples if s["step"] == m["step"]]
        first = [g for g in groups if ".b1." not in g["group_id"]]
        passing = [g for g in first if _differs(g, "accuracy")]
        drawn = 1 if len(passing) >= batch else max_batches
        assert m["gen_batches"] == drawn and len(groups) == batch * drawn, (m, groups)
        differing = [g for g in groups if _differs(g, "accuracy")]
        assert m["trained_groups"] == min(batch, len(differing)), (m, groups)
        # the groups left out had a summed-reward signal (length): the filter, not GRPO, removed them
        uniform_with_signal += sum(
            1
            for g in groups
            if not _differs(g, "accuracy") and len({r["total"] for r in g["rewards"]["rewards"]}) > 1
        )
        assert (m.get("skipped_update", 0.0) == 1.0) == (not differing), m
    assert uniform_with_signal > 0, (
        "no uniform-accuracy group had a length signal: the test would show nothing"
    )
    trained = trained_steps(metrics)  # the version moves by one on each trained step, not otherwise
    assert view["policy_version"] == len(trained)
