"""The sandbox tier's wire models (docs/sandbox.md): one program run in, one typed outcome out.

A run is one program (Python or bash) with its stdin and its limits; its outcome is a status that
says why it ended, never an exception: ``ok`` (exit 0), ``runtime_error`` (a non-zero exit or a
signal of its own), ``timeout`` (CPU or wall time), ``memory``, ``output_limit``, ``killed`` (ended
from outside: the health check, a killed runner), ``sandbox_error`` (the sandbox itself could not
run it). The reward service's code rewards send these over HTTP (``loom/clients/sandbox.py``); the
sandbox service's API and queue parse them once where they enter. Sessions (the sandbox as a tool) are
a Python interpreter kept across calls: ``SessionOpen`` in, ``SessionInfo`` out, then a
``SessionCall`` per cell answered by a ``CallResult`` whose status adds ``session_lost`` (the session
had ended; ``SessionInfo.ended`` says why).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from loom.contracts.wire import Contract

Language = Literal["python", "bash"]
RunStatus = Literal["ok", "runtime_error", "timeout", "memory", "output_limit", "killed", "sandbox_error"]

MAX_CODE_CHARS = 1_000_000
MAX_STDIN_CHARS = 10_000_000
MAX_BATCH = 256


class Limits(Contract):
    """What one run may use. Each bound is enforced by the kernel (rlimit, cgroup, tmpfs size) or by
    the runner's clock (wall time, output); the service caps them at its own maxima."""

    cpu_s: float = Field(default=5.0, gt=0, le=600, description="CPU seconds (RLIMIT_CPU, whole seconds up)")
    wall_s: float = Field(
        default=10.0, gt=0, le=600, description="wall-clock seconds, then every process dies"
    )
    memory_mb: int = Field(default=512, ge=16, le=65536, description="memory (cgroup, else RLIMIT_AS)")
    processes: int = Field(
        default=64, ge=1, le=4096, description="processes and threads (pids cgroup / NPROC)"
    )
    open_files: int = Field(default=64, ge=8, le=65536, description="open file descriptors (RLIMIT_NOFILE)")
    output_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20, description="stdout + stderr kept")
    tmp_mb: int = Field(default=64, ge=1, le=4096, description="size of the private /tmp (tmpfs)")


class RunRequest(Contract):
    language: Language = "python"
    code: str = Field(max_length=MAX_CODE_CHARS)
    stdin: str = Field(default="", max_length=MAX_STDIN_CHARS)
    limits: Limits = Field(default_factory=Limits)


class Output(Contract):
    """What a program or a cell wrote and what it took (a run's and a session call's)."""

    stdout: str = ""
    stderr: str = ""
    truncated: bool = Field(default=False, description="stdout/stderr were cut at output_bytes")
    wall_s: float = 0.0
    cpu_s: float = 0.0
    detail: str | None = None


class RunResult(Output):
    status: RunStatus
    exit_code: int | None = Field(default=None, description="the program's exit status; None if killed")
    signal: int | None = Field(default=None, description="the signal that ended it, if one did")


class BatchRequest(Contract):
    """Several independent runs in one call: each gets its own sandbox and its own outcome, so one
    bad program never fails its batch."""

    runs: list[RunRequest] = Field(min_length=1, max_length=MAX_BATCH)


class BatchResult(Contract):
    results: list[RunResult]


# ----------------------------------------------------------------------------- the sandbox as a tool

# why a session ended: a call's outcome that ends it, a spent budget, the idle TTL, a close
SessionEnd = Literal[
    "timeout", "memory", "output_limit", "killed", "exited", "sandbox_error",
    "cpu_budget", "wall_budget", "max_calls", "idle_ttl", "closed",
]  # fmt: skip
# a call's status: a run's, or ``session_lost`` (the session had ended before this call)
CallStatus = Literal[
    "ok", "runtime_error", "timeout", "memory", "output_limit", "killed", "sandbox_error", "session_lost"
]


class SessionLimits(Contract):
    """What one interpreter session may use over its life (a call's own bounds are its ``Limits``)."""

    cpu_budget_s: float = Field(default=60.0, gt=0, le=3600, description="CPU seconds of all its calls")
    wall_budget_s: float = Field(default=300.0, gt=0, le=86400, description="wall seconds of all its calls")
    idle_ttl_s: float = Field(
        default=300.0, gt=0, le=86400, description="reaped this long after its last call"
    )
    max_calls: int = Field(default=256, ge=1, le=100_000, description="calls before it ends")


class SessionOpen(Contract):
    """``POST /v1/sessions``: a Python interpreter that keeps its variables across calls."""

    limits: Limits = Field(default_factory=Limits, description="each call's limits")
    session: SessionLimits = Field(default_factory=SessionLimits)


class SessionInfo(Contract):
    id: str
    alive: bool
    calls: int = 0
    cpu_s: float = Field(default=0.0, description="CPU seconds its calls used")
    wall_s: float = Field(default=0.0, description="wall seconds its calls took")
    ended: SessionEnd | None = Field(default=None, description="why it ended, once it has")
    limits: Limits = Field(default_factory=Limits)
    session: SessionLimits = Field(default_factory=SessionLimits)


class SessionCall(Contract):
    """``POST /v1/sessions/{id}/run``: one cell; a last expression's ``repr`` is printed (a REPL's)."""

    code: str = Field(max_length=MAX_CODE_CHARS)


class CallResult(Output):
    status: CallStatus
    session: SessionInfo = Field(description="the session after this call (``alive`` false: it ended)")


class CellsRequest(Contract):
    """The queue's form (``sandbox.run_cells``): cells run in order in one fresh session, then closed."""

    cells: list[SessionCall] = Field(min_length=1, max_length=MAX_BATCH)
    limits: Limits = Field(default_factory=Limits)
    session: SessionLimits = Field(default_factory=SessionLimits)


class CellsResult(Contract):
    results: list[CallResult]
