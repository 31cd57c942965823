"""One program run inside bubblewrap, bounded by the kernel and the runner's clock (docs/sandbox.md).

What a run gets: new user, pid, network, IPC, UTS and cgroup namespaces (``--unshare-all``: no
network but its own loopback), a root that holds only ``/usr`` (read-only, with ``/bin``, ``/lib``
links), a stub ``/etc`` (``passwd`` and ``group`` naming one user), fresh ``/proc`` and ``/dev``, a
private size-bounded tmpfs ``/tmp`` (its working directory) and an empty environment. Nothing of the
service is bound: not its data dir, policy store, repository, virtualenv or environment.

Limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_NOFILE, RLIMIT_FSIZE (the tmpfs size), RLIMIT_CORE 0 and, when
the slot has no cgroup, RLIMIT_NPROC under the slot's own uid; the slot's cgroup (when the host lets
us make one) bounds memory and processes of the whole run. The runner's clock bounds wall time and the
output it keeps; a seccomp filter (``sandbox_svc/seccomp.py``) bounds the syscalls. At the end of a
run the pid namespace's init (bwrap) is gone, so the kernel kills every process the run started; the
slot's cgroup (or, without one, the slot's uid) is then emptied as well.

A sandbox is started before its program is known (``start``: the interpreter reads the program from a
pipe), so a slot keeps the next run's sandbox warm (``prestart``) and a run only writes its program
and stdin into it (``run``).
"""

from __future__ import annotations

import ctypes
import os
import resource
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loom.contracts.sandbox import Limits, RunRequest, RunResult, RunStatus
from sandbox_svc.cgroups import SlotGroup, make_group
from sandbox_svc.reaper import reap_orphans, started, waited

BWRAP = "/usr/bin/bwrap"
try:
    _LIBC: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # not glibc: --die-with-parent still ends the sandbox with bwrap
    _LIBC = None
_PR_SET_PDEATHSIG = 1
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "memory exhausted", "std::bad_alloc")
_STUB_PASSWD = "sandbox:x:1000:1000:sandbox:/tmp:/usr/sbin/nologin\n"
_STUB_GROUP = "sandbox:x:1000:\n"


def bwrap_path(preferred: str = "") -> str | None:
    """The bubblewrap binary (``preferred``, else the usual places), or None where it is not
    installed (deploy/setup.sh installs it)."""
    for p in (preferred, BWRAP, "/usr/local/bin/bwrap"):
        if p and os.access(p, os.X_OK):
            return p
    return None


@dataclass
class Slot:
    """A prepared runner slot: its own uid (when the service runs as root), cgroup, stub ``/etc`` and
    limits already written; a run only starts bwrap in it."""

    index: int
    uid: int | None
    group: SlotGroup | None
    etc: Path
    python: str = "/usr/bin/python3"  # the interpreter of Python runs: under /usr, the only host tree bound
    seccomp: bytes | None = None  # the filter its programs start under (sandbox_svc/seccomp.py)
    warm: Warm | None = None  # a sandbox started for the next run, waiting for its program
    pid: int | None = None  # the running bwrap, for the health check
    stop_reason: RunStatus | None = None  # set from outside to end the current run
    group_limits: tuple[int, int] | None = field(default=None)

    @classmethod
    def prepare(cls, index: int, uid_base: int, tag: str, use_cgroup: bool = True) -> Slot:
        etc = Path(tempfile.mkdtemp(prefix=f"loom-sandbox-etc-{index}-"))
        (etc / "passwd").write_text(_STUB_PASSWD)
        (etc / "group").write_text(_STUB_GROUP)
        (etc / "hostname").write_text("sandbox\n")
        for p in (etc, *etc.iterdir()):
            p.chmod(0o755 if p.is_dir() else 0o644)
        uid = uid_base + index if os.geteuid() == 0 else None
        group = make_group(f"loom-sandbox-{tag}-{index}") if use_cgroup else None
        return cls(index, uid, group, etc)

    def limit_group(self, limits: Limits) -> SlotGroup | None:
        """The slot's cgroup with this run's limits written (only when they change), or None."""
        if self.group is None:
            return None
        want = (limits.memory_mb << 20, limits.processes + 2)  # + bwrap's two processes
        if self.group_limits != want:
            try:
                self.group.set_limits(*want)
                self.group_limits = want
            except OSError:
                self.group.remove()
                self.group = None
                return None
        return self.group

    def stop(self, reason: RunStatus) -> None:
        """End the current run from another thread (health check, shutdown)."""
        self.stop_reason = reason
        if self.group is not None:
            self.group.kill_all()
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_uid(self) -> None:
        """SIGKILL every process of the slot's uid (a forked helper that takes the uid and signals -1):
        what a killed bwrap leaves when the slot has no cgroup to empty."""
        if self.uid is None:
            return
        pid = os.fork()
        if pid == 0:
            try:
                os.setgroups([])
                os.setgid(self.uid)
                os.setuid(self.uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    def close(self) -> None:
        if self.warm is not None:
            self.warm.discard()
            self.warm = None
        if self.group is not None:
            self.group.remove()
        for p in self.etc.iterdir():
            p.unlink()
        self.etc.rmdir()


def _interpreter(language: str, python: str, code_fd: int, args: tuple[str, ...] = ()) -> list[str]:
    """The interpreter, reading the program from ``code_fd`` (a pipe the runner writes it into
    when the run starts: until then the sandbox waits, set up, with its interpreter loaded), with
    the program's own ``args``."""
    if language == "python":
        return [python, "-I", "-B", f"/dev/fd/{code_fd}", *args]
    return ["/bin/bash", f"/dev/fd/{code_fd}", *args]


def command(
    bwrap: str,
    req: RunRequest,
    slot: Slot,
    code_fd: int,
    seccomp_fd: int | None = None,
    args: tuple[str, ...] = (),
) -> list[str]:
    lim = req.limits
    return [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--uid",
        "1000",
        "--gid",
        "1000",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin",
        "--setenv", "HOME", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        "--ro-bind", "/usr", "/usr",
        "--symlink", "usr/bin", "/bin",
        "--symlink", "usr/sbin", "/sbin",
        "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64",
        "--ro-bind", str(slot.etc), "/etc",
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(lim.tmp_mb << 20),
        "--tmpfs", "/dev/shm",  # POSIX semaphores and shared memory (multiprocessing), bounded as /tmp
        "--size", str(lim.tmp_mb << 20),
        "--tmpfs", "/tmp",
        "--remount-ro", "/",
        "--remount-ro", "/dev",  # its tmpfs is unbounded; device nodes stay usable
        "--chdir", "/tmp",
        *(("--seccomp", str(seccomp_fd)) if seccomp_fd is not None else ()),
        "--",
        *_interpreter(req.language, slot.python, code_fd, args),
    ]  # fmt: skip


_SH, _PRLIMIT, _SETPRIV = (shutil.which(t, path="/usr/bin:/bin") for t in ("sh", "prlimit", "setpriv"))
# joins the cgroup files named by its first $1 arguments, then execs the rest
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1"; shift; n=$((n-1)); done; exec "$@"'


def exec_chain(slot: Slot, group: SlotGroup | None, lim: Limits) -> list[str] | None:
    """The commands bwrap is exec'd through (``sh`` joins the slot's cgroup, util-linux's ``prlimit``
    sets the rlimits, ``setpriv`` takes the slot's uid and the parent-death signal), so the service
    never runs Python code in a forked child: the pool's threads make a ``preexec_fn`` unsafe (a lock
    held by another thread at the fork stays held in the child), and without one ``subprocess`` may
    use ``vfork``, not a full fork of the service. None where those tools are missing (then
    ``_child_setup`` does the same in a ``preexec_fn``)."""
    if not (_SH and _PRLIMIT and _SETPRIV):
        return None
    cpu = max(1, int(-(-lim.cpu_s // 1)))
    mem, fsize = lim.memory_mb << 20, lim.tmp_mb << 20
    limits = [
        f"--cpu={cpu}:{cpu + 1}",
        f"--as={mem}",
        f"--nofile={lim.open_files}",
        f"--fsize={fsize}",
        "--core=0",
    ]
    nproc = _nproc(slot, group, lim)
    if nproc is not None:
        limits.append(f"--nproc={nproc}")
    join = (
        [_SH, "-c", _JOIN, "sh", str(len(group.procs_files())), *map(str, group.procs_files())]
        if group
        else []
    )
    ident = [f"--reuid={slot.uid}", f"--regid={slot.uid}", "--clear-groups"] if slot.uid is not None else []
    return [*join, _PRLIMIT, *limits, "--", _SETPRIV, *ident, "--pdeathsig", "KILL", "--"]


def _nproc(slot: Slot, group: SlotGroup | None, lim: Limits) -> int | None:
    """RLIMIT_NPROC where no cgroup bounds processes: under the slot's own uid the run's allowance;
    under the service's user what that user runs now plus the allowance."""
    if group is not None:
        return None
    if slot.uid is not None:
        return lim.processes + 2
    return _user_processes(os.getuid()) + lim.processes + 2


def _child_setup(slot: Slot, group: SlotGroup | None, lim: Limits) -> Callable[[], None]:
    """Runs in the forked child before it execs bwrap: cgroup, rlimits, then the slot's uid."""
    cpu = max(1, int(-(-lim.cpu_s // 1)))
    mem = lim.memory_mb << 20
    uid = slot.uid
    nproc = _nproc(slot, group, lim)

    def setup() -> None:
        if group is not None:
            group.join_self()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lim.open_files, lim.open_files))
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.tmp_mb << 20, lim.tmp_mb << 20))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        if _LIBC is not None:  # loaded in the parent: the child only calls it (no import after fork)
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return setup


def _user_processes(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    n = 0
    for d in os.scandir("/proc"):
        if d.name.isdigit():
            try:
                st = os.stat(d.path)
            except OSError:
                continue
            if st.st_uid == uid:
                try:
                    n += len(os.listdir(f"{d.path}/task"))
                except OSError:
                    n += 1
    return n


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass
class Warm:
    """A started sandbox waiting for its program: bwrap set up, the interpreter loaded and blocked
    reading the program's pipe. ``key`` is the language and limits it was started with."""

    proc: subprocess.Popen[bytes]
    code_w: int
    stdin_w: int
    key: str

    def discard(self) -> None:
        for fd in (self.code_w, self.stdin_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            _, status = os.waitpid(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
        except ChildProcessError:
            self.proc.returncode = -signal.SIGKILL
        waited(self.proc.pid)  # and a returncode: Popen's own clean-up never polls a reused pid
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdout.close()
        self.proc.stderr.close()


def warm_key(req: RunRequest) -> str:
    return f"{req.language}:{req.limits.model_dump_json()}"


def start(shape: RunRequest, slot: Slot, bwrap: str) -> Warm | RunResult:
    """Start a sandbox for runs of ``shape``'s language and limits, waiting for its program."""
    reap_orphans()  # earlier runs' namespace inits still count against the slot's RLIMIT_NPROC
    lim = shape.limits
    group = slot.limit_group(lim)
    code_r, code_w = os.pipe()
    stdin_r, stdin_w = os.pipe()
    if slot.uid is not None:  # the interpreter reopens its program's pipe (/dev/fd/N) under the slot's uid
        os.fchown(code_r, slot.uid, slot.uid)
    filter_fd = _memfd("seccomp", slot.seccomp) if slot.seccomp is not None else None
    try:
        chain = exec_chain(slot, group, lim)
        with started() as own:
            proc = subprocess.Popen(
                [*(chain or ()), *command(bwrap, shape, slot, code_r, filter_fd)],
                stdin=stdin_r,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(code_r,) if filter_fd is None else (code_r, filter_fd),
                preexec_fn=None if chain is not None else _child_setup(slot, group, lim),
                close_fds=True,
                env={},  # bwrap's own processes are visible inside: they carry nothing of the service
            )
            own(proc.pid)
    except OSError as exc:
        os.close(code_w)
        os.close(stdin_w)
        return RunResult(status="sandbox_error", detail=f"could not start bubblewrap: {exc}")
    finally:
        os.close(code_r)
        os.close(stdin_r)
        if filter_fd is not None:
            os.close(filter_fd)
    return Warm(proc, code_w, stdin_w, warm_key(shape))


def _feed(warm: Warm, code: bytes, stdin: bytes) -> threading.Thread:
    """Write the program, then its stdin, in a thread of its own: a program that never reads its
    stdin blocks only this writer, which ends with the run (its pipe breaks)."""

    def write() -> None:
        for fd, data in ((warm.code_w, code), (warm.stdin_w, stdin)):
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:  # the run ended (or never read it): nothing more to give
                pass
            finally:
                os.close(fd)

    t = threading.Thread(target=write, name=f"sandbox-feed-{warm.proc.pid}", daemon=True)
    t.start()
    return t


def run(req: RunRequest, slot: Slot, bwrap: str | None = None) -> RunResult:
    """Run ``req`` in ``slot`` (in its warm sandbox when one waits with the same language and
    limits, else in one started now); never raises for anything the program does."""
    bwrap = bwrap or bwrap_path()
    if bwrap is None:
        return RunResult(status="sandbox_error", detail="bubblewrap is not installed (deploy/setup.sh)")
    warm, slot.warm = slot.warm, None
    if warm is not None and (warm.key != warm_key(req) or _exited(warm.proc.pid)):
        warm.discard()
        if slot.group is not None:
            slot.group.kill_all()
        warm = None
    if warm is None:
        started = start(req, slot, bwrap)
        if isinstance(started, RunResult):
            return started
        warm = started
    return _finish(warm, req, slot)


def _finish(warm: Warm, req: RunRequest, slot: Slot) -> RunResult:
    lim, proc = req.limits, warm.proc
    group = slot.group
    cpu0 = None
    if group is not None:
        group.reset()
        cpu0 = group.cpu_s()
    slot.stop_reason = None
    slot.pid = proc.pid
    t0 = time.monotonic()
    feeder = _feed(warm, req.code.encode(), req.stdin.encode())
    try:
        out, err, truncated, ended_by = _collect(proc, lim, t0, slot)
        _, wait_status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(wait_status)
        waited(proc.pid)
    finally:
        slot.pid = None
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        proc.stderr.close()
        if group is not None:
            group.kill_all()
        else:
            slot.kill_uid()
        feeder.join(5)
    wall = time.monotonic() - t0
    cpu = usage.ru_utime + usage.ru_stime  # bwrap's own; the run's from its cgroup where accounted
    cpu1 = group.cpu_s() if group is not None else None
    if cpu0 is not None and cpu1 is not None:
        cpu = max(cpu, cpu1 - cpu0)
    return _outcome(proc.returncode, out, err, truncated, ended_by, wall, cpu, lim, group)


def prestart(shape: RunRequest, slot: Slot, bwrap: str | None) -> None:
    """Leave a sandbox for the slot's next run waiting, set up for ``shape``'s language and limits
    (the last run's: consecutive runs of a reward batch share them)."""
    if bwrap is None or slot.warm is not None:
        return
    started = start(shape.model_copy(update={"code": "", "stdin": ""}), slot, bwrap)
    if isinstance(started, Warm):
        slot.warm = started


def _collect(
    proc: subprocess.Popen[bytes], lim: Limits, t0: float, slot: Slot
) -> tuple[bytes, bytes, bool, RunStatus | None]:
    """Read stdout and stderr until both close, the wall time passes or the output bound is passed
    (then the run is killed). Returns (stdout, stderr, truncated, why the runner ended it)."""
    assert proc.stdout is not None and proc.stderr is not None
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    deadline = t0 + lim.wall_s
    total, truncated, ended_by = 0, False, None
    died_at: float | None = None
    try:
        while sel.get_map():
            if slot.stop_reason is not None:
                ended_by = slot.stop_reason
                break
            if died_at is None and _exited(proc.pid):
                died_at = time.monotonic()
            elif died_at is not None and time.monotonic() - died_at > 0.5:
                break  # bwrap is gone but something still holds its pipes: no more output is the run's
            left = deadline - time.monotonic()
            if left <= 0:
                ended_by = "timeout"
                break
            for key, _ in sel.select(min(left, 0.25)):
                fd = int(key.fd)  # type: ignore[call-overload]
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = lim.output_bytes - total
                bufs[fd] += chunk[: max(0, room)]
                total += len(chunk)
                if total > lim.output_bytes:
                    truncated, ended_by = True, "output_limit"
                    break
            if ended_by:
                break
    finally:
        sel.close()
    pause = 0.001
    while ended_by is None and died_at is None and not _exited(proc.pid):
        # its output is closed but it runs on (it closed stdout and stderr itself): the wall still holds
        if slot.stop_reason is not None:
            ended_by = slot.stop_reason
        elif time.monotonic() >= deadline:
            ended_by = "timeout"
        else:
            time.sleep(pause)
            pause = min(0.05, pause * 2)
    if ended_by is not None or slot.stop_reason is not None or died_at is not None:
        ended_by = ended_by or slot.stop_reason
        _kill(proc, slot)
    return bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()]), truncated, ended_by


def _exited(pid: int) -> bool:
    """Has ``pid`` ended (without reaping it: ``os.wait4`` reads its status later)?"""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill(proc: subprocess.Popen[bytes], slot: Slot) -> None:
    """Killing bwrap ends the run's pid namespace; the slot's cgroup or uid catches what a killed
    bwrap leaves behind."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if slot.group is not None:
        slot.group.kill_all()
    else:
        slot.kill_uid()


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _outcome(
    code: int,
    out: bytes,
    err: bytes,
    truncated: bool,
    ended_by: RunStatus | None,
    wall: float,
    cpu: float,
    lim: Limits,
    group: SlotGroup | None,
) -> RunResult:
    stdout, stderr = _text(out), _text(err)
    # bwrap exits with the program's status, or 128 + the signal that ended it
    sig = -code if code < 0 else (code - 128 if code > 128 else None)
    exit_code = None if sig is not None else code
    base = RunResult(
        status="ok", stdout=stdout, stderr=stderr, truncated=truncated, wall_s=wall, cpu_s=cpu,
        exit_code=exit_code, signal=sig,
    )  # fmt: skip

    def outcome(status: RunStatus, detail: str | None = None) -> RunResult:
        return base.model_copy(update={"status": status, "detail": detail})

    if ended_by == "timeout":
        return outcome("timeout", f"wall time over {lim.wall_s} s")
    if ended_by is not None:
        why = {"output_limit": f"output over {lim.output_bytes} bytes", "killed": "ended by the runner"}
        return outcome(ended_by, why.get(ended_by, "stopped"))
    if code < 0:  # bwrap itself died of a signal (a program's own signal is bwrap's 128 + N)
        return outcome("killed", f"the runner was killed (signal {sig})")
    if code == 1 and stderr.startswith("bwrap:"):
        return outcome("sandbox_error", stderr.strip()[:500])
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= int(-(-lim.cpu_s // 1))):
        return outcome("timeout", f"CPU time over {lim.cpu_s} s")
    tail = stderr[-2000:]
    if code != 0 and ((group is not None and group.memory_hit()) or any(m in tail for m in _MEMORY_MARKERS)):
        return outcome("memory", f"memory over {lim.memory_mb} MB")
    return outcome("ok" if code == 0 else "runtime_error")
