"""The sandbox reaps its runs' orphaned namespace inits itself (sandbox_svc/reaper.py): a burst of
runs on one slot, several times its process allowance, never fails to fork, whatever the host's PID 1
does, and leaves no zombie child behind; the runs' own exit codes are read as before."""

from __future__ import annotations

import time

import pytest

from loom.contracts.sandbox import Limits, RunRequest
from sandbox_svc.pool import SandboxPool
from sandbox_svc.reaper import _children, _orphaned_init
from sandbox_svc.runner import bwrap_path

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed (deploy/setup.sh)")


def test_a_burst_past_the_process_allowance_runs_and_leaves_no_zombie() -> None:
    lim = Limits(cpu_s=2, wall_s=4, memory_mb=256, processes=8)
    pool = SandboxPool(1, queue_size=64)
    try:
        codes = ["import sys; sys.exit(3)", "print(1)", "assert 1 == 2"] * 12  # 36 runs, allowance 8 + 2
        results = pool.run_batch([RunRequest(code=c, limits=lim) for c in codes])
        assert [(r.status, r.exit_code) for r in results] == [
            ("runtime_error", 3),
            ("ok", 0),
            ("runtime_error", 1),
        ] * 12, [r.stderr for r in results if r.status == "sandbox_error"][:2]
        deadline = time.monotonic() + 5.0  # the last run's init is reaped by the next start or within 0.25 s
        while any(_orphaned_init(p) for p in _children()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in _children() if _orphaned_init(p)]
    finally:
        pool.close()
