"""bench/engine_sweep.py's ``--quick`` cells: both sides generate every row's tokens (``compare``
checks the counts), the table has one row per cell with finite positive ratios, and the engine held
every row of a cell in one batch."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_sweep_measures_every_cell_side_by_side(capsys) -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench.engine_sweep import QUICK, sweep

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = sweep(QUICK, reps=1, warmup=1)
    finally:
        torch.set_num_threads(threads)
    cells = [(s.name, rows, tokens) for s in QUICK for rows, tokens in s.cells]
    assert [(r["shape"], r["rows"], r["tokens"]) for r in results] == cells
    for r in results:
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("engine", "hf", "ratio", "cpu_ratio"))
        assert r["peak_rows"] == r["rows"]
    out = capsys.readouterr().out
    assert sum(line.startswith("| quick-") for line in out.splitlines()) == len(cells)
