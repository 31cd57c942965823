"""``loom up`` and ``loom status``: the whole stack as local processes on one machine.

``Stack`` starts, for each service, its API (``loom api SVC``) and its worker(s) (``loom worker SVC``)
as child processes, each in its own process group (so a Celery worker's prefork children are stopped
with it), logging to ``<data_dir>/logs/<proc>.log``; the logs of the previous ``keep_logs`` runs stay
beside it as ``<proc>.log.1`` (the last run) to ``.log.<keep_logs>`` (a crash's log survives the
restart that follows it). It waits until every API answers ``/readyz`` and
every worker has logged that it consumes, and stops everything on exit: SIGTERM to each process,
SIGKILL to its whole group after a grace period. Extra processes (``loom engine`` later) are
``ProcSpec`` entries passed as ``extra=``; they are started first and waited on the same way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import psutil

from loom.contracts.settings import SERVICES, Settings, get_settings

LOG_KEEP = 5  # previous runs' logs kept per process
WORKER_READY_LINE = " ready."  # Celery's worker logs "<hostname> ready." once it consumes its queue
STACK_KEY_NAME = "loom-up"
STACK_KEY_SCOPES = "jobs+runs+admin"


class StackError(RuntimeError):
    """A process of the stack failed to start or died; ``proc`` names it, ``log_tail`` shows why."""

    def __init__(self, message: str, proc: str = "", log_tail: str = "") -> None:
        self.proc = proc
        self.log_tail = log_tail
        super().__init__(message + (f"\n--- last lines of {proc}'s log ---\n{log_tail}" if log_tail else ""))


@dataclass
class ProcSpec:
    """One child process: ready when ``ready_url`` answers 200 and ``ready_log`` appears in its log."""

    name: str
    argv: list[str]
    service: str = ""
    ready_url: str | None = None
    ready_log: str | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Proc:
    spec: ProcSpec
    popen: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    ready: bool = False

    @property
    def name(self) -> str:
        return self.spec.name


def settings_env(settings: Settings) -> dict[str, str]:
    """``settings`` as ``LOOM_*`` variables, so every child sees exactly the parent's settings."""
    env: dict[str, str] = {}
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, Path):
            value = value.resolve()
        elif isinstance(value, list | dict | tuple):
            value = json.dumps(value)
        env[f"LOOM_{name.upper()}"] = str(value)
    return env


def loom_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def service_specs(settings: Settings, services: Sequence[str] = SERVICES, workers: int = 1) -> list[ProcSpec]:
    """API + ``workers`` worker processes per service (``workers=0``: APIs only)."""
    specs: list[ProcSpec] = []
    for svc in services:
        if svc not in SERVICES:
            raise ValueError(f"unknown service {svc!r}; expected some of {', '.join(SERVICES)}")
        specs.append(
            ProcSpec(
                f"{svc}-api", loom_argv("api", svc), svc, ready_url=settings.service_url(svc) + "/readyz"
            )
        )
        for i in range(1, workers + 1):
            specs.append(
                ProcSpec(f"{svc}-worker-{i}", loom_argv("worker", svc), svc, ready_log=WORKER_READY_LINE)
            )
    return specs


def _die_with_parent() -> None:
    """Child set-up: own process group, and SIGTERM if ``loom up`` itself is killed (Linux)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def rotate(path: Path, keep: int = LOG_KEEP) -> None:
    """``<name>.log`` becomes ``<name>.log.1``, ``.1`` becomes ``.2`` ... and the one past ``keep`` is
    dropped (``keep`` = 0: the log is simply replaced)."""
    if keep <= 0 or not path.exists():
        return
    older = [path.with_name(f"{path.name}.{i}") for i in range(1, keep + 1)]
    older[-1].unlink(missing_ok=True)
    for i in range(keep - 1, 0, -1):
        if older[i - 1].exists():
            older[i - 1].replace(older[i])
    path.replace(older[0])


def tail(path: Path, lines: int = 30) -> str:
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def stack_env(settings: Settings, api_key: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every child: ``settings`` as ``LOOM_*`` variables, one torch thread each, then
    ``env``; ``api_key``'s hash joins LOOM_API_KEYS after the keys the user configured."""
    threads = str(settings.torch_threads)
    out = {
        **os.environ,
        **settings_env(settings),
        # one torch thread per process on purpose: many processes share few cores (loom/runtime.py)
        "LOOM_TORCH_THREADS": threads,
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    entry = f"{STACK_KEY_NAME}:{hashlib.sha256(api_key.encode()).hexdigest()}:{STACK_KEY_SCOPES}"
    out["LOOM_API_KEYS"] = ",".join(k for k in (settings.api_keys.strip(" ,"), entry) if k)
    # the internal routes' secret (loom/service_token.py): one per stack unless the operator set one
    out["LOOM_SERVICE_TOKEN"] = out.get("LOOM_SERVICE_TOKEN") or secrets.token_urlsafe(32)
    return out


def terminate(procs: Sequence[Proc], grace: float, hurried: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every process, wait up to ``grace`` seconds (less once ``hurried()``), then SIGKILL their
    process groups and every descendant still alive; close their logs."""
    family: list[psutil.Process] = []
    for proc in procs:
        family.extend(_family(proc.popen.pid))
    for proc in procs:
        if proc.popen.poll() is None:
            try:
                proc.popen.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurried():
        if all(p.popen.poll() is not None for p in procs) and not _alive(family):
            break
        time.sleep(0.1)
    for proc in procs:
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)  # the group outlives its leader
        except (ProcessLookupError, PermissionError):
            pass
    for p in _alive(family):
        try:
            p.kill()
        except psutil.Error:
            pass
    for proc in procs:
        try:
            proc.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        proc.log_file.close()
    psutil.wait_procs(family, timeout=5)


class Stack:
    """The stack as a context manager: ``with Stack(settings) as stack: stack.smoke()``."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        services: Sequence[str] = SERVICES,
        workers: int = 1,
        extra: Sequence[ProcSpec] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 120.0,
        grace: float = 10.0,
        echo: bool = False,
        keep_logs: int = LOG_KEEP,
    ) -> None:
        self.settings = settings or get_settings()
        self.keep_logs = keep_logs
        self.services = tuple(services)
        self.workers = workers
        self.specs = [*extra, *service_specs(self.settings, self.services, workers)]
        self.ready_timeout = ready_timeout
        self.grace = grace
        self.echo = echo
        self.procs: list[Proc] = []
        self.log_dir = Path(self.settings.data_dir).resolve() / "logs"
        # A gateway key with every scope that lives as long as this stack (smoke, `loom demo`)
        self.api_key = "loom_" + secrets.token_urlsafe(32)
        self.env = stack_env(self.settings, self.api_key, env)
        self.hurry = False  # set by a second Ctrl-C: skip the grace period

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start every process and wait until all are ready; raises ``StackError`` naming a failure."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for spec in self.specs:
            self.procs.append(self._spawn(spec))
        self.wait_ready()

    def _spawn(self, spec: ProcSpec) -> Proc:
        log_path = self.log_dir / f"{spec.name}.log"
        rotate(log_path, self.keep_logs)
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        popen = subprocess.Popen(
            spec.argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**self.env, **spec.env},
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - only os/ctypes calls, no locks
        )
        self._say(f"started {spec.name} (pid {popen.pid}) -> {log_path}")
        return Proc(spec, popen, log_path, log_file)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(timeout=2.0) as http:
            while True:
                self.check()
                for proc in self.procs:
                    if not proc.ready and self._is_ready(proc, http):
                        proc.ready = True
                        self._say(f"ready   {proc.name}")
                pending = [p for p in self.procs if not p.ready]
                if not pending:
                    return
                if time.monotonic() > deadline:
                    first = pending[0]
                    names = ", ".join(p.name for p in pending)
                    raise StackError(
                        f"not ready after {self.ready_timeout:.0f} s: {names}",
                        first.name,
                        tail(first.log_path),
                    )
                time.sleep(0.25)

    @staticmethod
    def _is_ready(proc: Proc, http: httpx.Client) -> bool:
        spec = proc.spec
        if spec.ready_log is not None:
            proc.log_file.flush()
            if spec.ready_log not in tail(proc.log_path, 400):
                return False
        if spec.ready_url is not None:
            try:
                if http.get(spec.ready_url).status_code != 200:
                    return False
            except httpx.HTTPError:
                return False
        return True

    def check(self) -> None:
        """Raise ``StackError`` if any child has exited (it never should while the stack runs)."""
        for proc in self.procs:
            code = proc.popen.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                raise StackError(f"{proc.name} exited unexpectedly ({how})", proc.name, tail(proc.log_path))

    def stop(self) -> None:
        """SIGTERM every process, wait up to ``grace`` seconds, then SIGKILL their process groups."""
        if not self.procs:
            return
        terminate(self.procs, self.grace, lambda: self.hurry)
        self._say("stopped")
        self.procs = []

    # ---------------------------------------------------------------- use

    def pids(self) -> list[int]:
        """Every live process of the stack, children of children included."""
        return [p.pid for proc in self.procs for p in _family(proc.popen.pid)]

    def urls(self) -> dict[str, str]:
        return {svc: self.settings.service_url(svc) for svc in self.services}

    def smoke(self, timeout: float = 30.0) -> dict[str, Any]:
        """Round-trip a task through the queues: via the gateway when the whole stack runs, else each
        started service's own ``/v1/ping``. Returns ``{"ok": bool, "queues": {queue: result}}``.
        The gateway's ping takes the stack's admin key, another service's the service token."""
        targets = ["gateway"] if set(SERVICES) <= set(self.services) else list(self.services)
        out: dict[str, Any] = {"ok": True, "queues": {}}
        with httpx.Client(timeout=timeout + 10) as http:
            for svc in targets:
                secret = self.api_key if svc == "gateway" else self.env["LOOM_SERVICE_TOKEN"]
                r = http.post(
                    self.settings.service_url(svc) + "/v1/ping",
                    json={"timeout": timeout},
                    headers={"Authorization": f"Bearer {secret}"},
                )
                body = r.json()
                out["queues"].update(body.get("queues", {}))
                out["ok"] = out["ok"] and r.status_code == 200 and bool(body.get("ok"))
        return out

    def describe(self) -> str:
        lines = [f"{'SERVICE':<9} {'API':<28} WORKERS  LOGS"]
        for svc in self.services:
            n = sum(1 for p in self.procs if p.spec.service == svc and "-worker-" in p.name)
            lines.append(f"{svc:<9} {self.settings.service_url(svc):<28} {n:<8} {self.log_dir}/{svc}-*.log")
        for p in self.procs:
            if not p.spec.service:
                lines.append(f"{p.name:<9} {p.spec.ready_url or '-':<28} {'-':<8} {p.log_path}")
        broker = "embedded" if self.settings.embedded else _redact(self.settings.broker_url)
        lines.append(f"broker: {broker}   data: {Path(self.settings.data_dir).resolve()}")
        return "\n".join(lines)

    def _say(self, msg: str) -> None:
        if self.echo:
            print(f"loom up: {msg}", flush=True)


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _alive(procs: Sequence[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


# -------------------------------------------------------------------- loom up


class _Stop(Exception):
    pass


def _services_arg(value: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    bad = [s for s in names if s not in SERVICES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown service(s) {bad}; choose from {', '.join(SERVICES)}")
    return names


def up_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="loom up", description="start the whole stack on this machine")
    p.add_argument("--smoke", action="store_true", help="once ready, ping every queue, stop, exit 0/1")
    p.add_argument("--only", type=_services_arg, default=SERVICES, help="comma-separated services")
    p.add_argument("--workers", type=int, default=1, help="worker processes per service (default 1)")
    p.add_argument("--no-workers", action="store_true", help="start the APIs only")
    p.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for /readyz")
    p.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument(
        "--keep-logs",
        type=int,
        default=LOG_KEEP,
        help=f"previous runs' logs kept per process as <proc>.log.1 .. .N (default {LOG_KEEP})",
    )
    args = p.parse_args(argv)
    if args.workers < 0:
        p.error("--workers must be >= 0")
    if args.keep_logs < 0:
        p.error("--keep-logs must be >= 0")
    workers = 0 if args.no_workers else args.workers
    if args.smoke and workers == 0:
        p.error("--smoke needs workers")

    stack = Stack(
        services=args.only,
        workers=workers,
        ready_timeout=args.ready_timeout,
        grace=args.grace,
        echo=True,
        keep_logs=args.keep_logs,
    )

    def on_signal(signum: int, frame: object) -> None:
        raise _Stop(signal.Signals(signum).name)

    def hurry(signum: int, frame: object) -> None:
        stack.hurry = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        stack.start()
        print(stack.describe(), flush=True)
        if args.smoke:
            result = stack.smoke()
            print(json.dumps(result, indent=2), flush=True)
            print(f"loom up: smoke {'ok' if result['ok'] else 'FAILED'}", flush=True)
            code = 0 if result["ok"] else 1
        else:
            print("loom up: all ready; Ctrl-C to stop", flush=True)
            while True:
                stack.check()
                time.sleep(0.5)
    except _Stop as exc:
        print(f"loom up: {exc}, stopping", flush=True)
    except StackError as exc:
        print(f"loom up: error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except Exception as exc:
        print(f"loom up: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        for s in old:
            signal.signal(s, hurry)
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return code


# -------------------------------------------------------------------- loom status


def service_health(settings: Settings, service: str, http: httpx.Client) -> dict[str, Any]:
    url = settings.service_url(service)
    row: dict[str, Any] = {"service": service, "url": url, "healthz": "down", "readyz": "down", "checks": {}}
    try:
        row["healthz"] = "ok" if http.get(url + "/healthz").status_code == 200 else "failing"
        r = http.get(url + "/readyz")
        body = r.json()
        row["readyz"] = body.get("status", str(r.status_code))
        row["checks"] = body.get("checks", {})
    except (httpx.HTTPError, ValueError):
        pass
    return row


def queue_report(settings: Settings) -> tuple[dict[str, int | None], str]:
    """Depth of every queue, or an error message when the broker cannot be reached."""
    try:
        from loom.queue import make_celery, queue_depths

        return queue_depths(make_celery("gateway", settings)), ""
    except Exception as exc:
        return {}, f"{type(exc).__name__}: {exc}"


def status_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="loom status", description="health of every service and queue depths")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--only", type=_services_arg, default=SERVICES, help="comma-separated services")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per HTTP probe")
    args = p.parse_args(argv)
    settings = get_settings()
    with httpx.Client(timeout=args.timeout) as http:
        rows = [service_health(settings, svc, http) for svc in args.only]
    depths, broker_error = queue_report(settings)
    for row in rows:
        row["queue_depth"] = depths.get(row["service"])
    ready = all(r["readyz"] == "ready" for r in rows)
    if args.json:
        report = {"ready": ready, "services": rows, "queues": depths, "broker_error": broker_error or None}
        print(json.dumps(report, indent=2))
    else:
        print(_table(rows))
        if broker_error:
            print(f"queues: broker unreachable ({broker_error})")
    return 0 if ready else 1


def _table(rows: list[dict[str, Any]]) -> str:
    head = ("SERVICE", "URL", "HEALTHZ", "READYZ", "QUEUE")
    body = [
        (
            r["service"],
            r["url"],
            r["healthz"],
            r["readyz"],
            "?" if r["queue_depth"] is None else str(r["queue_depth"]),
        )
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in (head, *body)
    )
