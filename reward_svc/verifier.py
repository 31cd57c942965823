"""One verifier process: forked from a reward process that already loaded math-verify, it checks
items one at a time in its main thread (math-verify's timeouts are ``signal.alarm``) and answers on
its pipe. ``reward_svc.pool`` forks, schedules and kills these (docs/security-workers.md).

Every worker verifies the warm-up strings itself right after its fork: the copy-on-write faults of
what the parent loaded are taken then, not by its first real item.
"""

from __future__ import annotations

import mmap
import os
import resource
import signal
import struct
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from reward_svc.mathverify import Checker, MathItem, install_guards

_PR_SET_PDEATHSIG = 1
NONE_TAKEN = 2**31 - 1  # a worker's mark while nothing in its pipe is taken back


def _page_kb() -> int:
    return os.sysconf("SC_PAGE_SIZE") // 1024


def _statm_kb() -> tuple[int, int]:
    """(virtual size, resident size) of this process in KiB."""
    with open("/proc/self/statm") as f:
        size, rss = f.read().split()[:2]
    return int(size) * _page_kb(), int(rss) * _page_kb()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # not Linux: the pipe's EOF still ends the worker
        pass


def read_mark(mark: mmap.mmap) -> int:
    return int(struct.unpack_from("i", mark)[0])


def write_mark(mark: mmap.mmap, value: int) -> None:
    struct.pack_into("i", mark, 0, value)  # 4 aligned bytes: never seen half-written


def worker_main(conn: Connection, close: Sequence[Any], mark: mmap.mmap, mem_limit_mb: int) -> None:
    """Body of a forked worker. Never returns: always ``os._exit``."""
    code = 0
    try:
        for c in close:
            if isinstance(c, int):
                os.close(c)
            else:
                c.close()
        # Inherited handlers would run the parent's shutdown logic (asyncio's wakeup fd is shared).
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        vm_kb, _ = _statm_kb()
        if mem_limit_mb > 0:
            limit = vm_kb * 1024 + mem_limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        install_guards()
        checker = Checker()
        for gold, answer in zip(_WARM, _WARM[1:] + _WARM[:1], strict=True):
            # touch what the parent's warm-up loaded: the copy-on-write faults are taken here, not by
            # the first real item (on a loaded machine beside hostile items, ~1 s of a spare's first
            # item before this)
            checker.check(MathItem(gold, "boxed", answer), 2)
        while True:
            try:
                seq, item, timeout_s = conn.recv()
            except (EOFError, OSError):
                break
            if seq > read_mark(mark):  # taken back while it waited in the pipe: another worker runs it
                conn.send(None)
                continue
            verdict = checker.check(item, timeout_s)
            conn.send((verdict, _statm_kb()[1]))
    except BaseException:
        code = 1
    finally:
        os._exit(code)


_WARM = (
    "\\frac{1}{2}",
    "0.5",
    "(1,2]",
    "\\{1,2\\}",
    "x^2+\\sqrt{3}",
    "10\\%",
    "[-2,\\infty)",
    "\\frac{\\pi}{4}",
)


def warm_up() -> None:
    """Import math-verify and run its parser and verifier on fixed, trusted strings in this (parent)
    process, so every forked worker starts with the grammar and sympy paths loaded: a cold worker pays
    ~0.5 s, and with one verify only a fresh worker's first realistic item still took ~0.4 s (every
    neighbouring pair verified: ~0.08 s; measured with reward_svc.corpus.realistic_mix). Never called
    on model text; timeouts are off because this may run outside a main thread."""
    import math_verify.grader as mvg
    import math_verify.parser as mvp
    from math_verify import LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0)]
    shown = mvp.TIMEOUT_WARNING_SHOWN, mvg.TIMEOUT_WARNING_SHOWN
    mvp.TIMEOUT_WARNING_SHOWN = mvg.TIMEOUT_WARNING_SHOWN = True  # no "timeout disabled" warning
    try:
        parsed = [parse("\\boxed{" + s + "}", config, parsing_timeout=None) for s in _WARM]  # type: ignore[arg-type]
        for a, b in zip(parsed, parsed[1:] + parsed[:1], strict=True):
            verify(a, b, timeout_seconds=None)
    finally:
        mvp.TIMEOUT_WARNING_SHOWN, mvg.TIMEOUT_WARNING_SHOWN = shown
