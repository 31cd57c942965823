"""The interpreter loop of a sandbox session: runs inside bubblewrap, never in the service.

``sandbox_svc/session.py`` writes this file's text into the sandbox's program pipe, so it runs under
the system ``/usr/bin/python3`` with the standard library only (nothing of Loom is inside). Its
argv holds two pipe fds: requests in, replies out, each a frame of a 4-byte big-endian length and a
JSON object (docs/sandbox.md "The sandbox as a tool"). A request ``{"code", "cpu_s"}`` is one cell:
it runs in the session's one namespace (variables persist), a last expression's ``repr`` is printed
as a REPL prints it, stdout and stderr are flushed, and the reply ``{"status", "error", "cpu"}``
follows (``ok``, ``runtime_error`` or ``memory``; the CPU seconds used so far). The service reads
stdout and stderr itself and bounds the call's wall time and output; this loop only sets the call's
CPU allowance (the soft RLIMIT_CPU: what the session used so far plus the call's ``cpu_s``, never
above the hard limit, the session's budget).
"""

import ast
import json
import os
import resource
import struct
import sys
import traceback


def _read(fd: int, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def _send(fd: int, obj: dict) -> None:
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _cpu_used() -> float:
    """CPU seconds of this interpreter and the children it waited for (the service's count where
    the slot has no cgroup to account it)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _allow_cpu(cpu_s: float) -> None:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    used = ru.ru_utime + ru.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used + cpu_s + 0.999)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _cell(code: str, ns: dict) -> str:
    tree = ast.parse(code, "<cell>", "exec")
    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    if last is not None:
        tree.body.pop()
    exec(compile(tree, "<cell>", "exec"), ns)  # noqa: S102 - running the cell is this loop's job
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)  # noqa: S307 - as above
        if value is not None:
            print(repr(value))
    return "ok"


def main() -> None:
    req_fd, rep_fd = int(sys.argv[1]), int(sys.argv[2])
    for fd in (req_fd, rep_fd):
        os.set_inheritable(fd, False)  # a cell's subprocesses never hold the session's channel
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    me = os.getpid()
    _send(rep_fd, {"ready": True})
    while True:
        head = _read(req_fd, 4)
        if not head:
            return
        req = json.loads(_read(req_fd, struct.unpack(">I", head)[0]))
        error = None
        try:
            _allow_cpu(float(req.get("cpu_s", 5.0)))
            status = _cell(req["code"], ns)
        except MemoryError:
            status, error = "memory", "MemoryError"
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the session goes on
            status, error = "runtime_error", f"{type(exc).__name__}: {exc}"[:500]
            tb = exc.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename != "<cell>":
                tb = tb.tb_next  # the cell's own frames, not this loop's
            traceback.print_exception(type(exc), exc, tb)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if os.getpid() != me:  # a process the cell forked, back here: it must never answer a call
            os._exit(0 if status == "ok" else 1)
        _send(rep_fd, {"status": status, "error": error, "cpu": _cpu_used()})


main()
