"""Interpreter sessions: the sandbox as a tool (docs/sandbox.md "The sandbox as a tool").

A session is one long-lived Python interpreter (``sandbox_svc/session_server.py``) in a bubblewrap
sandbox set up as a one-shot run's (``sandbox_svc/runner.py``: namespaces, read-only root, private
tmp, empty environment, rlimits, the slot's uid and cgroup, seccomp), its variables kept across
calls. The service talks to it over two pipes in frames (a 4-byte length and JSON) and reads its
stdout and stderr itself, so each call is bounded here as a run is: its wall time and output by this
process's clock and counter, its CPU by the soft RLIMIT_CPU the loop sets per call, its memory by the
session's cgroup (or RLIMIT_AS). A session is bounded over its life too: total CPU (the hard
RLIMIT_CPU as well), total wall time of its calls, calls, and an idle TTL (the reaper thread).

A call that ends in ``timeout``, ``memory``, ``output_limit`` or ``killed`` ends its session (the
interpreter's state after it is not trusted: a half-done cell, a killed child): its process and
everything it started are killed, the call reports the status, and every later call answers
``session_lost`` naming why. ``ok`` and ``runtime_error`` (an exception in the cell) keep it. At most
``max_sessions`` live at once: another open raises ``Busy`` (HTTP 429), never waits.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import selectors
import signal
import struct
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from loom.closing import Closing
from loom.contracts.sandbox import (
    CallResult,
    CallStatus,
    Limits,
    RunRequest,
    SessionEnd,
    SessionInfo,
    SessionLimits,
    SessionOpen,
)
from sandbox_svc.cgroups import sweep_stale
from sandbox_svc.pool import _SLOT_INDEX, Busy, default_ceiling
from sandbox_svc.reaper import adopt_orphans, reap_orphans, release_orphans, started, waited
from sandbox_svc.runner import (
    _MEMORY_MARKERS,
    Slot,
    _child_setup,
    _exited,
    _memfd,
    bwrap_path,
    command,
    exec_chain,
)
from sandbox_svc.seccomp import program

log = logging.getLogger("sandbox_svc.session")

SERVER = (Path(__file__).with_name("session_server.py")).read_bytes()
_MAX_FRAME = 1 << 16
_START_S = 15.0  # a session's interpreter must say ready within this (bubblewrap set-up, import)
_ENDING: dict[str, SessionEnd] = {"timeout": "timeout", "memory": "memory", "output_limit": "output_limit"}


class SessionBusy(Exception):
    """A call is already running in this session: calls of one session run one at a time (409)."""


class UnknownSession(KeyError):
    """No session of this id lives or ended recently in this process (404)."""


@dataclass
class _Proc:
    """The sandboxed interpreter: bwrap's process, the request and reply pipes, stdout and stderr."""

    popen: subprocess.Popen[bytes]
    req_w: int
    rep_r: int
    writer: threading.Thread | None = None  # the last request's writer (it may outlive a killed call)

    def fds(self) -> tuple[int, int]:
        assert self.popen.stdout is not None and self.popen.stderr is not None
        return self.popen.stdout.fileno(), self.popen.stderr.fileno()

    def kill(self) -> None:
        try:
            os.kill(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def reap(self) -> int:
        """Wait for bwrap (killed or ended) and close every pipe; its exit code as ``Popen`` says."""
        self.kill()
        code = self.popen.wait()
        waited(self.popen.pid)
        if self.writer is not None:  # its pipe broke with the process: it ends before its fd closes
            self.writer.join(5)
        for fd in (self.req_w, self.rep_r):
            try:
                os.close(fd)
            except OSError:
                pass
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self.popen.stdout.close()
        self.popen.stderr.close()
        return code


def _session_shape(limits: Limits, budget: SessionLimits) -> Limits:
    """The limits the sandbox starts under: a call's, with the session's CPU budget as RLIMIT_CPU
    (the loop lowers the soft limit per call; the hard one stays the budget's)."""
    return limits.model_copy(update={"cpu_s": budget.cpu_budget_s})


def start_process(slot: Slot, limits: Limits, budget: SessionLimits, bwrap: str) -> _Proc | str:
    """Start the session's sandbox and wait for its interpreter's ready frame; a reason on failure."""
    reap_orphans()  # ended sessions' namespace inits still count against the slot's RLIMIT_NPROC
    shape = _session_shape(limits, budget)
    group = slot.limit_group(shape)
    code_r, code_w = os.pipe()
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    if slot.uid is not None:  # the interpreter reopens its program's pipe under the slot's uid
        os.fchown(code_r, slot.uid, slot.uid)
    filter_fd = _memfd("seccomp", slot.seccomp) if slot.seccomp is not None else None
    passed = (code_r, req_r, rep_w) + ((filter_fd,) if filter_fd is not None else ())
    try:
        chain = exec_chain(slot, group, shape)
        argv = command(
            bwrap, RunRequest(code="", limits=shape), slot, code_r, filter_fd, (str(req_r), str(rep_w))
        )
        with started() as own:
            popen = subprocess.Popen(
                [*(chain or ()), *argv],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=passed,
                preexec_fn=None if chain is not None else _child_setup(slot, group, shape),
                close_fds=True,
                env={},
            )
            own(popen.pid)
    except OSError as exc:
        for fd in (code_w, req_w, rep_r):
            os.close(fd)
        return f"could not start bubblewrap: {exc}"
    finally:
        for fd in passed:
            os.close(fd)
    try:
        os.write(code_w, SERVER)  # a few KB: the pipe's buffer holds it before the interpreter reads
    except OSError:  # bubblewrap ended already: the ready frame never comes, its stderr says why
        pass
    os.close(code_w)
    proc = _Proc(popen, req_w, rep_r)
    out = _exchange(proc, None, limits.model_copy(update={"output_bytes": 1 << 16}), _START_S)
    if out.reply != {"ready": True}:
        proc.reap()
        return f"the session's interpreter did not start: {_text(out.err).strip()[:300] or out.ended_by}"
    return proc


@dataclass
class _Exchange:
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    reply: dict[str, object] | None = None
    truncated: bool = False
    ended_by: str | None = None  # timeout | output_limit | closed | eof | bad_frame


def _exchange(
    proc: _Proc, frame: bytes | None, lim: Limits, wall_s: float, stop: threading.Event | None = None
) -> _Exchange:
    """Send ``frame`` (None: none) and read stdout, stderr and the reply channel until a reply frame,
    the wall time, the output bound, the reply channel's end or ``stop``."""
    x, rep = _Exchange(), bytearray()
    out_fd, err_fd = proc.fds()
    if frame is not None:
        proc.writer = threading.Thread(target=_write_all, args=(proc.req_w, frame), daemon=True)
        proc.writer.start()
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd, proc.rep_r):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline, total = time.monotonic() + wall_s, 0
    try:
        while x.ended_by is None and x.reply is None:
            left = deadline - time.monotonic()
            if stop is not None and stop.is_set():
                x.ended_by = "closed"
            elif left <= 0:
                x.ended_by = "timeout"
            for key, _ in sel.select(min(max(left, 0), 0.25)) if x.ended_by is None else ():
                fd = int(key.fd)  # type: ignore[call-overload]
                chunk = _read_some(fd)
                if chunk is None:
                    continue
                if fd == proc.rep_r:
                    if not chunk:
                        x.ended_by = "eof"
                    rep += chunk
                    x.reply, bad = _frame(rep)
                    x.ended_by = "bad_frame" if bad else x.ended_by
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                total += _keep(x, fd == out_fd, chunk, lim.output_bytes - total)
                if total > lim.output_bytes:
                    x.truncated, x.ended_by = True, "output_limit"
                    break
        if x.reply is not None:  # the loop flushed before replying: what it wrote is in the pipes
            for fd, is_out in ((out_fd, True), (err_fd, False)):
                while (chunk := _read_some(fd)) and total <= lim.output_bytes:
                    total += _keep(x, is_out, chunk, lim.output_bytes - total)
            if total > lim.output_bytes:
                x.truncated, x.ended_by, x.reply = True, "output_limit", None
    finally:
        sel.close()
    return x


def _keep(x: _Exchange, is_out: bool, chunk: bytes, room: int) -> int:
    (x.out if is_out else x.err).extend(chunk[: max(0, room)])
    return len(chunk)


def _read_some(fd: int) -> bytes | None:
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:  # the session ended: the call's outcome says why
        pass


def _frame(buf: bytearray) -> tuple[dict[str, object] | None, bool]:
    """A complete reply frame from ``buf`` (or None yet), and whether what arrived is malformed."""
    if len(buf) < 4:
        return None, False
    (n,) = struct.unpack(">I", bytes(buf[:4]))
    if n > _MAX_FRAME:
        return None, True
    if len(buf) < 4 + n:
        return None, False
    try:
        obj = json.loads(bytes(buf[4 : 4 + n]))
    except ValueError:
        return None, True
    return (obj, False) if isinstance(obj, dict) else (None, True)


def _text(data: bytes | bytearray) -> str:
    return bytes(data).decode("utf-8", "replace")


class Session:
    """One interpreter session: its process, slot, budgets and counters. Thread-safe: one call at a
    time (``SessionBusy`` for a second), ``end`` from any thread."""

    def __init__(self, sid: str, slot: Slot, proc: _Proc, req: SessionOpen) -> None:
        self.id, self.slot, self.proc = sid, slot, proc
        self.limits, self.budget = req.limits, req.session
        self.calls, self.cpu_s, self.wall_s = 0, 0.0, 0.0
        self.ended: SessionEnd | None = None
        self.last_used = time.monotonic()
        self._call_lock = threading.Lock()
        self._state = threading.Lock()
        self._stop = threading.Event()
        self._cleaned = False
        self._cpu_seen = 0.0

    def info(self) -> SessionInfo:
        return SessionInfo(
            id=self.id, alive=self.ended is None, calls=self.calls, cpu_s=self.cpu_s, wall_s=self.wall_s,
            ended=self.ended, limits=self.limits, session=self.budget,
        )  # fmt: skip

    @property
    def in_call(self) -> bool:
        return self._call_lock.locked()

    def end(self, reason: SessionEnd) -> bool:
        """End the session (first reason wins): kill its process; free it now unless a call runs
        (that call frees it when it returns). False when it had ended already."""
        with self._state:
            if self.ended is not None:
                return False
            self.ended = reason
        self._stop.set()
        self.proc.kill()
        if self._call_lock.acquire(blocking=False):
            try:
                self._cleanup()
            finally:
                self._call_lock.release()
        return True

    def _cleanup(self) -> None:
        if self._cleaned:
            return
        self._cleaned = True
        self.proc.reap()
        if self.slot.group is not None:
            self.slot.group.kill_all()
        else:
            self.slot.kill_uid()
        self.slot.close()

    def call(self, code: str) -> CallResult:
        if not self._call_lock.acquire(blocking=False):
            if self.ended is not None:  # ending: its clean-up holds the lock; the call is lost, not busy
                return self._lost(f"the session ended before this call: {self.ended}")
            raise SessionBusy(self.id)
        try:
            return self._call(code)
        finally:
            self.last_used = time.monotonic()
            if self.ended is not None:
                self._cleanup()
            self._call_lock.release()

    def _lost(self, why: str) -> CallResult:
        return CallResult(status="session_lost", detail=why, session=self.info())

    def _call(self, code: str) -> CallResult:
        if self.ended is not None:
            return self._lost(f"the session ended before this call: {self.ended}")
        if _exited(self.proc.popen.pid):
            self.end("killed")
            return self._lost("the session's process was killed before this call: its state is gone")
        wall = min(self.limits.wall_s, self.budget.wall_budget_s - self.wall_s)
        cpu = min(self.limits.cpu_s, self.budget.cpu_budget_s - self.cpu_s)
        group = self.slot.group
        cpu0 = group.cpu_s() if group is not None else None
        if group is not None:
            group.reset()
        frame = json.dumps({"code": code, "cpu_s": cpu}).encode()
        t0 = time.monotonic()
        x = _exchange(self.proc, struct.pack(">I", len(frame)) + frame, self.limits, wall, self._stop)
        took = time.monotonic() - t0
        cpu1 = group.cpu_s() if group is not None else None
        used = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else self._own_cpu(x, took, cpu)
        self.calls += 1
        self.cpu_s += used
        self.wall_s += took
        status, detail, ending = self._classify(x, wall, cpu)
        if ending is None:
            ending = self._spent()
        if ending is not None:
            self.end(ending)
        return CallResult(
            status=status, stdout=_text(x.out), stderr=_text(x.err), truncated=x.truncated,
            wall_s=took, cpu_s=used, detail=detail, session=self.info(),
        )  # fmt: skip

    def _own_cpu(self, x: _Exchange, took: float, allowed: float) -> float:
        """Without cgroup accounting: the interpreter's own count (its reply's), else the call's
        allowance; a cell could misreport it, but the hard RLIMIT_CPU bounds the truth either way."""
        seen = x.reply.get("cpu") if x.reply is not None else None
        if isinstance(seen, int | float) and seen >= self._cpu_seen:
            used, self._cpu_seen = float(seen) - self._cpu_seen, float(seen)
            return used
        return min(took, allowed)

    def _spent(self) -> SessionEnd | None:
        b = self.budget
        if self.calls >= b.max_calls:
            return "max_calls"
        if self.cpu_s >= b.cpu_budget_s:
            return "cpu_budget"
        if self.wall_s >= b.wall_budget_s:
            return "wall_budget"
        return None

    def _classify(
        self, x: _Exchange, wall: float, cpu: float
    ) -> tuple[CallStatus, str | None, SessionEnd | None]:
        """The call's status, its detail, and why the session ends with it (None: it goes on)."""
        lim = self.limits
        if x.reply is not None:
            st = str(x.reply.get("status"))
            if st == "memory":
                return "memory", f"memory over {lim.memory_mb} MB: the session ended", "memory"
            if st in ("ok", "runtime_error"):
                return st, (str(x.reply["error"]) if x.reply.get("error") else None), None  # type: ignore[return-value]
            return "killed", "the session's reply was malformed: the session ended", "killed"
        if x.ended_by == "timeout":
            budget = wall < lim.wall_s
            why = "the session's wall budget is spent" if budget else f"wall time over {wall:g} s"
            return "timeout", f"{why}: the session ended", "wall_budget" if budget else "timeout"
        if x.ended_by == "output_limit":
            return "output_limit", f"output over {lim.output_bytes} bytes: the session ended", "output_limit"
        if x.ended_by == "closed":
            return "killed", f"the session was ended during the call ({self.ended})", None
        if x.ended_by == "bad_frame":
            return "killed", "the session's reply was malformed: the session ended", "killed"
        return self._died(x, cpu)

    def _died(self, x: _Exchange, cpu: float) -> tuple[CallStatus, str | None, SessionEnd | None]:
        """The interpreter ended during the call (its reply channel closed): why, from its status."""
        self.proc.kill() if not _wait_exit(self.proc.popen.pid, 2.0) else None
        code = self.proc.popen.wait()
        waited(self.proc.popen.pid)
        sig = -code if code < 0 else (code - 128 if code > 128 else None)
        tail = _text(x.err[-2000:])
        group = self.slot.group
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and self.cpu_s >= self.budget.cpu_budget_s):
            spent = self.cpu_s >= self.budget.cpu_budget_s
            return (
                "timeout",
                f"CPU time over {cpu:g} s: the session ended",
                "cpu_budget" if spent else "timeout",
            )
        if (group is not None and group.memory_hit()) or any(m in tail for m in _MEMORY_MARKERS):
            return "memory", f"memory over {self.limits.memory_mb} MB: the session ended", "memory"
        if sig is not None:
            return "killed", f"the session's process was killed (signal {sig}): the session ended", "killed"
        return "runtime_error", f"the interpreter exited (status {code}): the session ended", "exited"


def _wait_exit(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if _exited(pid):
            return True
        time.sleep(0.01)
    return _exited(pid)


@dataclass
class SessionStats:
    opened: int = 0
    refused: int = 0
    calls: int = 0
    ended: dict[str, int] = field(default_factory=dict)


class SessionManager(Closing):
    """The process's sessions: at most ``max_sessions`` live (``Busy`` beyond), each on a slot of its
    own (uid, cgroup, stub ``/etc``: never a one-shot pool's); ended ones are remembered (the last
    ``remember``) so a late call answers ``session_lost`` with the reason, not an unknown id. A reaper
    thread ends sessions idle past their TTL."""

    def __init__(
        self,
        max_sessions: int = 8,
        *,
        max_limits: Limits | None = None,
        max_session: SessionLimits | None = None,
        use_cgroup: bool = True,
        use_seccomp: bool = True,
        python: str = "/usr/bin/python3",
        bwrap: str = "",
        remember: int = 4096,
        reap_every_s: float = 0.5,
    ) -> None:
        self.max_sessions = max(1, max_sessions)
        self.max_limits = max_limits or default_ceiling()
        self.max_session = max_session or SessionLimits(
            cpu_budget_s=600, wall_budget_s=3600, idle_ttl_s=3600, max_calls=10_000
        )
        self.bwrap, self.python = bwrap_path(bwrap), python
        self.seccomp = program() if use_seccomp else None
        self.stats = SessionStats()
        self._use_cgroup, self._remember = use_cgroup, remember
        self._tag = f"{os.getpid()}-s{id(self) % 10000}"
        self._uid_base = 200_000 + (os.getpid() % 4096) * 4096  # the pools' base: slot indices are shared
        self._lock = threading.Lock()
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()
        self._opening = 0
        self._closed = threading.Event()
        adopt_orphans()  # ended sessions' namespace inits are this process's to reap (sandbox_svc/reaper.py)
        if use_cgroup:
            sweep_stale()
        self._reaper = threading.Thread(
            target=self._reap, args=(reap_every_s,), name="sandbox-reaper", daemon=True
        )
        self._reaper.start()

    @classmethod
    def from_settings(cls, s: object) -> SessionManager:
        """The sessions of a sandbox process (``sandbox_svc.config.SandboxSettings``)."""
        return cls(
            s.sessions,  # type: ignore[attr-defined]
            max_limits=s.max_limits(),  # type: ignore[attr-defined]
            max_session=s.max_session(),  # type: ignore[attr-defined]
            python=s.python,  # type: ignore[attr-defined]
            bwrap=s.bwrap,  # type: ignore[attr-defined]
        )

    def capped(self, req: SessionOpen) -> SessionOpen:
        """``req`` with each limit at most the service's maximum."""
        lim = {k: min(getattr(req.limits, k), getattr(self.max_limits, k)) for k in Limits.model_fields}
        ses = {
            k: min(getattr(req.session, k), getattr(self.max_session, k)) for k in SessionLimits.model_fields
        }
        return SessionOpen(limits=Limits(**lim), session=SessionLimits(**ses))

    def open(self, req: SessionOpen) -> SessionInfo:
        """A new session (its interpreter started and ready), or ``Busy`` when ``max_sessions`` live;
        a session the sandbox could not start is answered ended with ``sandbox_error``."""
        req = self.capped(req)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("sandbox sessions are closed")
            if len(self._live) + self._opening >= self.max_sessions:
                self.stats.refused += 1
                raise Busy(len(self._live) + self._opening, self.max_sessions, retry_after_s=1.0)
            self._opening += 1
        try:
            slot = Slot.prepare(next(_SLOT_INDEX) % 4096, self._uid_base, self._tag, self._use_cgroup)
            slot.python, slot.seccomp = self.python, self.seccomp
            sid = secrets.token_urlsafe(12)
            started = (
                start_process(slot, req.limits, req.session, self.bwrap)
                if self.bwrap
                else "bubblewrap is not installed (deploy/setup.sh)"
            )
            if isinstance(started, str):
                slot.close()
                log.warning("sandbox session could not start: %s", started)
                return SessionInfo(
                    id=sid, alive=False, ended="sandbox_error", limits=req.limits, session=req.session
                )
            session = Session(sid, slot, started, req)
            with self._lock:
                self._live[sid] = session
                self.stats.opened += 1
            return session.info()
        finally:
            with self._lock:
                self._opening -= 1

    def get(self, sid: str) -> Session:
        with self._lock:
            s = self._live.get(sid) or self._ended.get(sid)
        if s is None:
            raise UnknownSession(sid)
        return s

    def call(self, sid: str, code: str) -> CallResult:
        """Run one cell in session ``sid`` (``UnknownSession``, ``SessionBusy``)."""
        s = self.get(sid)
        result = s.call(code)
        with self._lock:
            self.stats.calls += 1
        if s.ended is not None:
            self._forget(s)
        return result

    def end(self, sid: str) -> SessionInfo:
        """End session ``sid`` (``closed``); closing an ended one answers its info as it stands."""
        s = self.get(sid)
        s.end("closed")
        self._forget(s)
        return s.info()

    def run_cells(self, req: SessionOpen, cells: list[str]) -> list[CallResult]:
        """Cells in order in one fresh session, closed at the end (the queue's form); after a cell
        that ends the session the rest answer ``session_lost``."""
        info = self.open(req)
        if not info.alive:
            why = f"the sandbox could not start a session ({info.ended})"
            return [CallResult(status="sandbox_error", detail=why, session=info) for _ in cells]
        try:
            return [self.call(info.id, c) for c in cells]
        finally:
            self.end(info.id)

    def health(self) -> dict[str, object]:
        with self._lock:
            return {
                "live": len(self._live),
                "max_sessions": self.max_sessions,
                "in_call": sum(1 for s in self._live.values() if s.in_call),
                "opened": self.stats.opened,
                "refused": self.stats.refused,
                "calls": self.stats.calls,
                "ended": dict(self.stats.ended),
            }

    def slot_uids(self) -> list[int]:
        with self._lock:
            return [s.slot.uid for s in self._live.values() if s.slot.uid is not None]

    def close(self) -> None:
        """End every session and stop the reaper (the process's shutdown)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            live = list(self._live.values())
        for s in live:
            s.end("closed")
            self._forget(s)
        self._reaper.join(timeout=5)
        release_orphans()

    def _forget(self, s: Session) -> None:
        """Move an ended session to the remembered ones (counted once by its reason)."""
        with self._lock:
            if self._live.pop(s.id, None) is None:
                return
            self._ended[s.id] = s
            reason = s.ended or "closed"
            self.stats.ended[reason] = self.stats.ended.get(reason, 0) + 1
            while len(self._ended) > self._remember:
                self._ended.popitem(last=False)

    def _reap(self, every_s: float) -> None:
        while not self._closed.wait(every_s):
            reap_orphans()
            now = time.monotonic()
            with self._lock:
                live = list(self._live.values())
            for s in live:
                if s.in_call:
                    continue
                if now - s.last_used > s.budget.idle_ttl_s:
                    log.info("sandbox session %s idle past its TTL: reaped", s.id)
                    s.end("idle_ttl")
                elif _exited(s.proc.popen.pid):  # killed between calls: reported, never left hanging
                    log.warning("sandbox session %s: its process died between calls", s.id)
                    s.end("killed")
                if s.ended is not None:
                    self._forget(s)
