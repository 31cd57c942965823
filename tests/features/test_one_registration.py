"""One registration per feature (docs/architecture.md, "One registration per feature"): a scratch
estimator, a scratch rollout mode and a scratch reward component, each one module
(``tests/features/scratch/{estimators,modes,rewards}/scratch.py``) plus its params model and one
line in its contract table (``tests/features/scratch/contracts.py``), run through the product's own
path: the rollout dispatch with the torch engine on the tiny model, the reward service's scoring,
the learner's train step with the estimator's assignment and loss. Nothing else is registered: the
product finds each module by its name. In a process of its own, since a table line must be in place
when the wire models are built (``Mode`` and ``Estimator`` derive from the tables)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# one process loads the tiny model twice (engine and learner) and trains a step: ~20 s of CPU
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOOM_DATA_DIR": str(tmp_path_factory.mktemp("data"))}
    out = subprocess.run(
        [sys.executable, "-m", "tests.features.scratch.run", str(tmp_path_factory.mktemp("scratch"))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_scratch_mode_is_dispatched_with_its_own_params(report: dict) -> None:
    assert report["group_mode"] == "scratch"
    assert report["trajectories"] == 2 * 3  # n=2 per round, mode_params.rounds=3
    assert report["refusals"]["mode"] == "mode_params.rounds must be in [1, 4], got 9"


def test_the_built_in_dataset_and_the_demo_pose_a_scratch_mode_from_its_table_line(report: dict) -> None:
    posed = report["posed"]
    assert len(posed["dataset_prompts"]) == 2
    assert all(p.startswith("[plain] ") for p in posed["dataset_prompts"])  # the default format
    assert posed["dataset_mode_params"] == [{}, {}]
    assert posed["demo_lists_it"] and posed["demo_run"] == {"mode": "scratch", "reward": ["accuracy"]}


def test_a_scratch_component_is_scored_with_the_verdicts_it_declared(report: dict) -> None:
    # the spec names the scratch component alone: its ``reads("accuracy")`` made the verifier run
    assert report["rewards"] and all(abs(r) == 2.0 for r in report["rewards"])  # +-bonus, bonus=2
    assert report["refusals"]["component"] == "['body', 'spec', 'components', 0, 'params', 'bonus']"


def test_a_scratch_estimator_assigns_and_trains_with_its_own_loss(report: dict) -> None:
    assert report["calls"] == {"assign": 1, "loss": 1}  # one group, one micro-batch
    assert report["policy_version"] == 1 and report["samples"] == 6
    # A_i = scale (R_i - baseline) = 3 (R_i + 1) on every completion token
    adv = [3.0 * (r + 1.0) for r in report["rewards"]]
    tokens = report["completion_tokens"]
    expected = sum(abs(a) * n for a, n in zip(adv, tokens, strict=True)) / sum(tokens)
    assert report["adv_abs_mean"] == pytest.approx(expected, rel=1e-6)
    assert "['scael'] are not read by estimator 'scratch'" in report["refusals"]["estimator"]
