"""bench/learner.py --size: a random-weight model from a config, full vs LoRA vs FSDP in one table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def table_rows(out: str) -> dict[str, list[str]]:
    """The printed table's rows by variant name (the header and the rule left out)."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("variant",) and not cells[0].startswith("---"):
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
def test_size_variants_table_has_full_lora_fsdp_and_lora_holds_less() -> None:
    cmd = [sys.executable, "bench/learner.py", "--size", "2m", "--variants", "full,lora,fsdp"]
    cmd += ["--steps", "1", "--groups", "2", "--g", "4", "--len", "48"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "model=llama-2m (1.8 M parameters" in done.stdout
    rows = table_rows(done.stdout)
    assert set(rows) == {"full", "lora", "fsdp x2"}, done.stdout
    # cells: trainable params, step s, tokens/s, trainable + AdamW MiB, held MiB, peak MiB
    for name, cells in rows.items():
        assert float(cells[1]) > 0 and float(cells[2]) > 0, (name, cells)
    trained = {name: float(cells[3]) for name, cells in rows.items()}
    assert trained["lora"] < trained["full"] / 10  # rank-8 adapter on q/k/v/o: ~1.5% of the weights
    # FSDP over 2 ranks: rank 0 holds about half of the parameters and AdamW state
    assert trained["fsdp x2"] == pytest.approx(trained["full"] / 2, rel=0.05)
