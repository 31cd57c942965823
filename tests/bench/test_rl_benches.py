"""The paper benches' RL loop (bench/adasr.py, bench/rea.py) on the tiny model: both arms train, the
engine serves what they published, the table holds both arms with finite numbers."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from loom.contracts.wire import Group, Segment, Trajectory

REPO = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--task", "arith", "--steps", "2", "--prompts", "2", "--group", "4"]
TINY += ["--eval", "4", "--max-tokens", "96", "--lr", "1e-4"]


def bench(name: str) -> ModuleType:
    """bench/<name>.py as a module (bench/ is scripts, not an installed package)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def table_row(out: str, arm: str) -> list[float]:
    """The numbers of ``arm``'s line in the printed table (``a -> b`` cells give both)."""
    line = next(x for x in out.splitlines() if x.startswith(arm + " "))
    cells = line[len(arm) :].replace("->", " ").split()
    return [float(c) for c in cells if c != "-"]


def check_arms(results: list, out: str, arms: tuple[str, str], md: Path) -> None:
    assert [r.arm.name for r in results] == list(arms)
    for r in results:
        assert r.weight_change > 0.0, f"{r.arm.name}: the weights did not move from the start checkpoint"
        assert r.policy_version > 0, f"{r.arm.name}: the engine still serves the start checkpoint"
        assert len(r.steps) == 2
        numbers = table_row(out, r.arm.name)
        assert len(numbers) >= 8 and all(math.isfinite(x) for x in numbers), numbers
    start = table_row(out, "start")
    assert start and all(math.isfinite(x) for x in start)
    text = md.read_text()
    assert all(f"| {a} |" in text for a in arms)
    assert md.with_suffix(".png").stat().st_size > 0


@pytest.mark.slow
def test_adasr_bench_trains_grpo_and_hrpo_from_the_same_start(tmp_path: Path, capsys) -> None:
    adasr = bench("adasr")
    md = tmp_path / "adasr.md"
    results = adasr.main([*TINY, "--out", str(md)])
    check_arms(results, capsys.readouterr().out, ("grpo", "hrpo"), md)
    # same prompts and seeds: the first step samples the same responses in both arms
    assert results[0].steps[0].means == results[1].steps[0].means


@pytest.mark.slow
def test_rea_bench_trains_both_arms_and_keeps_revisions(tmp_path: Path, capsys) -> None:
    rea = bench("rea")
    md = tmp_path / "rea.md"
    results = rea.main([*TINY, "--out", str(md)])
    check_arms(results, capsys.readouterr().out, ("length", "reflection+truncation"), md)
    assert sum(s.revisions for s in results[1].steps) > 0, "gold truncation kept no revision"
    assert results[0].steps[0].means == results[1].steps[0].means


def test_streaming_phase_counts_only_the_models_stream_tokens() -> None:
    adasr = bench("adasr")
    t = Trajectory(
        id="g/0",
        group_id="g",
        completion_ids=list(range(12)),
        # observation (3), thought of 2 + forced <EOT> (masked), deep of 4, answer of 2
        loss_mask=[0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1],
        segments=[
            Segment(kind="observation", start=0, end=3),
            Segment(kind="stream", start=3, end=6),
            Segment(kind="deep", start=6, end=10),
            Segment(kind="answer", start=10, end=12),
        ],
    )
    assert adasr.phase_lengths(Group(id="g", trajectories=[t])) == [{"stream": 2.0, "deep": 4.0}]
