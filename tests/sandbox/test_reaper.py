"""The sandbox reaps its runs' orphaned namespace inits itself (sandbox_svc/reaper.py): a burst of
runs on one slot, several times its process allowance, never fails to fork, whatever the host's PID 1
does, and leaves no zombie child behind; the runs' own exit codes are read as before."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from loom.contracts.sandbox import Limits, RunRequest
from sandbox_svc.pool import SandboxPool
from sandbox_svc.reaper import _children, _orphaned_init, reap_orphans, started, waited
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


def _state(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[0]


def test_a_zombie_bwrap_that_leads_no_session_is_reaped_unless_its_starter_waits_for_it(
    tmp_path: Path,
) -> None:
    """A real child named ``bwrap`` that exits without ``setsid`` (its session is this process's): a
    starter that registered it keeps it for its own wait; once it has said ``waited``, or had it
    never registered, the reaper takes it."""
    exe = tmp_path / "bwrap"
    shutil.copy("/bin/true", exe)
    with started() as own:
        pid = os.posix_spawn(str(exe), [str(exe)], {})
        own(pid)
    deadline = time.monotonic() + 30.0
    while _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _state(pid) == "Z" and os.getsid(pid) == os.getsid(0)  # a zombie that leads no session
    reap_orphans()
    assert _state(pid) == "Z"  # its starter's to wait for
    waited(pid)
    assert _reaped(pid, deadline)
    stray = os.posix_spawn(str(exe), [str(exe)], {})  # never registered
    assert _reaped(stray, deadline)


def _reaped(pid: int, deadline: float) -> bool:
    """Reaped by ``reap_orphans`` (here, or by an open pool's health thread: the suite's other tests')."""
    while _state(pid) is not None and time.monotonic() < deadline:
        reap_orphans()
        time.sleep(0.01)
    return _state(pid) is None
