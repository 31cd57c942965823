"""bench/learner.py --packing: padded, packed, (--row-mask) the row-masked packed learner and (--compile)
the compiled packed learner in one table, with the compiled one's distance from the packed one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_packing_bench_prints_the_four_learners_side_by_side() -> None:
    # --compile eager: dynamo's graphs without code generation (inductor's C++ builds are the bench's)
    cmd = [sys.executable, "bench/learner.py", "--packing", "--size", "2m", "--row-mask", "--steps", "1"]
    cmd += ["--compile", "eager"]
    cmd += ["--groups", "2", "--g", "8", "--min-len", "8", "--max-len", "64"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {}
    for line in done.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "learner" and not cells[0].startswith("---"):
            rows[cells[0]] = cells[1:]
    names = [
        "padded (before issue 37)",
        "packed + chunked head",
        "packed, row mask, logits recomputed",
        "packed + eager",
    ]
    assert list(rows) == names, done.stdout
    # cells: micro-batches, computed tokens, computed / real, step s, tokens/s, vs padded, CPU s, vs padded
    ratio = {name: float(cells[2]) for name, cells in rows.items()}
    assert ratio[names[1]] == ratio[names[2]] == ratio[names[3]] < ratio[names[0]]  # the same packed rows
    # the compiled learner computes what the packed one does, and the timed steps compile nothing
    same = next(line for line in done.stdout.splitlines() if line.startswith("packed + eager vs packed"))
    diffs = [float(m) for m in re.findall(r"max \|diff\| ([0-9.e+-]+)", same)]
    assert len(diffs) == 3 and max(diffs) <= 1e-5, same
    compiled = re.search(r"graphs compiled: (\d+) before the timed steps, (\d+) during them", same)
    assert compiled and int(compiled[1]) > 0 and int(compiled[2]) == 0, same
    assert "warm-up (compilation included" in done.stdout
    for name, cells in rows.items():
        assert float(cells[3]) > 0 and float(cells[4]) > 0 and float(cells[6]) > 0, (name, cells)
    assert rows[names[0]][5] == "1.00x" and rows[names[0]][7] == "1.00x"
