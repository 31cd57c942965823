"""bench/agent_tree.py and bench/agent_overhead.py, tiny: the tree's numbers come from real groups
(fewer generated tokens than its leaves hold), and both sides of the overhead bench decode the very
same episodes."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace

import pytest

from tests.bench.test_rl_benches import REPO, bench


@pytest.fixture(scope="module")
def tiny_engine():  # type: ignore[no-untyped-def]
    from loom.runtime import configure_process
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR

    configure_process()
    return TorchEngine(CHECKPOINT_DIR, cache_entries=64)


def test_the_tree_bench_counts_tokens_and_accuracy_of_real_groups(tiny_engine):
    from zoo.search import search_problems

    mod = bench("agent_tree")
    a = Namespace(initial=1, iterations=1, max_tokens=48, temperature=1.0)
    r = mod.one_seed(tiny_engine, search_problems("countdown", 1, seed=7), "entropy", 0, a)
    assert r["leaves"] > 1 and 0 < r["tree_tok"] < r["eq_tok"]  # equal leaves: the tree decodes less
    assert 1 <= r["k"] < r["leaves"]  # fewer independent episodes fit in the tree's tokens
    assert 0.0 <= r["tree_acc"] <= 1.0 and 0.0 <= r["tok_acc"] <= 1.0
    assert "| entropy / 0 | " in mod.row("entropy / 0", r)


@pytest.mark.slow
def test_the_overhead_bench_runs_the_same_episodes_on_both_sides():
    out = subprocess.run(
        [
            sys.executable,
            "bench/agent_overhead.py",
            "--prompts",
            "1",
            "--reps",
            "1",
            "--max-tokens",
            "48",
            "--max-turns",
            "6",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "same ids on both sides: 1/1" in out.stdout and "overhead" in out.stdout
