"""Reaping the sandbox's orphaned namespace inits, whatever the host's PID 1 does.

bubblewrap with ``--unshare-pid`` runs two processes: the one the runner starts (and waits for) and
the new namespace's init, which calls ``setsid`` (``--new-session``) and is orphaned when the first
one ends. An orphan is reparented to the nearest subreaper, else PID 1, and stays a zombie until that
process waits for it. Not every PID 1 does so promptly (a container started without ``init: true``,
a VM whose init is a plain agent: measured here, a burst of 96 runs left 64 zombies of one slot's uid
for tens of seconds), and a zombie still counts against its uid's RLIMIT_NPROC, so a slot's next runs
failed to fork ("bwrap: Can't fork for pid 1") until PID 1 came round. The sandbox's process therefore
makes itself a child subreaper and reaps those orphans itself, before every start and from the pool's
health thread.

Only orphaned namespace inits are reaped: a zombie child whose command is ``bwrap`` and which is not
one the runner or a session started and will wait for itself (``started``: they register it while
holding the lock the reaper takes; ``waited`` drops it after their wait). Leading its own session is
not required: zombie ``bwrap`` children that lead none were seen in the suite (tests/sandbox/
test_hostile.py after tests/reward/test_code.py), never reaped, each counting against its slot's
RLIMIT_NPROC. Any other child of the process is left to whoever started it. The process adopts
orphans only while a pool or a session manager is open in it: a process that embeds the sandbox (a
test run) hands the orphans of its other children back to PID 1 once the last one closes.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_PR_SET_CHILD_SUBREAPER = 36
_lock = threading.Lock()
_holders = 0  # the pools and session managers open in this process
_spawn = threading.RLock()  # held while a bwrap is started and registered, and while reaping
_started: set[int] = set()  # bwrap processes that their starter waits for


@contextmanager
def started() -> Iterator[Callable[[int], None]]:
    """``with started() as own: proc = Popen(...); own(proc.pid)``: the reaper never takes a bwrap
    its starter is about to wait for, even one that died at once."""
    with _spawn:
        yield _started.add


def waited(pid: int) -> None:
    """The starter has waited for ``pid``: it is no longer one to leave alone."""
    _started.discard(pid)


def _subreaper(on: bool) -> bool:
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux ≥ 3.4) while a pool or a session
    manager is open in it (``release_orphans`` when it closes); False where it cannot."""
    global _holders
    with _lock:
        _holders += 1
        return _subreaper(True)


def release_orphans() -> None:
    """A pool or session manager closed: reap what is left, and where none is open any more stop
    adopting (a process that embeds the sandbox, a test run, gets its other orphans' old parent
    back: PID 1)."""
    global _holders
    reap_orphans()
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            _subreaper(False)


def _children() -> list[int]:
    pids: list[int] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return pids
    for t in tasks:
        try:
            with open(f"/proc/self/task/{t}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    return pids


def _orphaned_init(pid: int) -> bool:
    """A zombie ``bwrap`` child that no starter waits for (the fields of proc(5)'s ``stat``)."""
    if pid in _started:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    fields = stat[stat.rfind(")") + 2 :].split()
    # fields: state ppid pgrp session ...
    return comm == "bwrap" and len(fields) > 3 and fields[0] == "Z"


def reap_orphans() -> int:
    """Wait for every orphaned namespace init that is this process's child now; how many."""
    n = 0
    with _spawn:
        for pid in _children():
            if _orphaned_init(pid):
                try:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        n += 1
                except ChildProcessError:
                    continue
    return n
