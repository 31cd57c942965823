"""The sandbox service running as an unprivileged user (docs/sandbox.md "Without root"): ``loom api
sandbox`` started as ``nobody`` (``setpriv``; as this user when the tests themselves are not root),
driven over HTTP. A subset of the hostile matrix and the session tool give the same typed outcomes as
under root; where root's limits are missing (a uid per slot, the cgroup), the fallback is checked to
hold: runs and sessions of the one uid cannot reach each other (pid namespaces), a fork bomb is held
by RLIMIT_NPROC and leaves nothing behind, memory is held by RLIMIT_AS."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loom.clients.sandbox import SandboxClient
from loom.clients.sandbox_session import SandboxSessionClient
from loom.contracts.sandbox import Limits, RunRequest
from sandbox_svc.runner import bwrap_path

REPO = Path(__file__).resolve().parents[2]
SECRET = "loom-unprivileged-token-0b3a"
FAST = Limits(cpu_s=2, wall_s=8, memory_mb=256, processes=32, tmp_mb=8, output_bytes=64 << 10)
NOBODY = 65534


def _as_user() -> list[str]:
    """The prefix that drops to ``nobody`` (nothing when the tests run unprivileged already)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is missing: cannot drop to an unprivileged user")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all", "--"]


def _bwrap_runs_unprivileged(prefix: list[str], bwrap: str) -> str | None:
    argv = [*prefix, bwrap, "--unshare-all", "--unshare-user", "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
            "--dev", "/dev", "--", "/usr/bin/true"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={})
    return None if r.returncode == 0 else (r.stderr.strip() or f"exit {r.returncode}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def service() -> Iterator[tuple[str, int]]:
    """(url, pid) of ``loom api sandbox`` running as an unprivileged user, its environment holding a
    service token."""
    bwrap = bwrap_path()
    if bwrap is None:
        pytest.skip("bubblewrap is not installed (deploy/setup.sh)")
    prefix = _as_user()
    why = _bwrap_runs_unprivileged(prefix, bwrap)
    if why is not None:
        pytest.skip(f"bubblewrap cannot run unprivileged on this host: {why}")
    home = Path(tempfile.mkdtemp(prefix="loom-unprivileged-"))  # pytest's own tmp is root's alone (0700)
    home.chmod(0o777)
    port = _free_port()
    env = {
        "PATH": "/usr/bin:/bin", "HOME": str(home), "PYTHONPATH": str(REPO),
        "LOOM_DATA_DIR": str(home / "data"),
        "LOOM_SERVICE_TOKEN": SECRET, "LOOM_SANDBOX_SLOTS": "2", "LOOM_SANDBOX_SESSIONS": "3",
    }  # fmt: skip
    argv = ["sandbox", "--host", "127.0.0.1", "--port", str(port)]
    code = f"import sys\nfrom launch.cli import api_main\nsys.exit(api_main({argv!r}))"
    log = (home / "service.log").open("wb")
    proc = subprocess.Popen([*prefix, sys.executable, "-c", code], env=env, cwd=home, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"the unprivileged service exited: {(home / 'service.log').read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def sandbox_processes(service_pid: int) -> int:
    """The service's processes and its sandboxes': every process of ``nobody`` when the service was
    dropped to it (one that escaped its sandbox counts too), else the service's descendants."""
    if os.geteuid() != 0:
        return descendants(service_pid)
    n = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                n += d.stat().st_uid == NOBODY and not zombie(d)
            except OSError:
                pass
    return n


def zombie(proc: Path) -> bool:
    """An ended process waiting to be reaped: a killed sandbox's inner bwrap is reparented to PID 1,
    which on some hosts (this VM's init) reaps late. It runs nothing and holds no memory, so it is
    not a process that outlived its run."""
    return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def settled_processes(service_pid: int, quiet_s: float = 1.0, limit_s: float = 30.0) -> int:
    """``sandbox_processes`` once it has held still for ``quiet_s`` (within ``limit_s``): after a run
    its slot prestarts the next sandbox, which a count taken too soon would miss."""
    deadline = time.monotonic() + limit_s
    count, since = sandbox_processes(service_pid), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = sandbox_processes(service_pid)
        if now != count:
            count, since = now, time.monotonic()
    return count


def descendants(root: int) -> int:
    """Processes under ``root`` (the service): its sandboxes and whatever they started."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    n = 0
    for pid in parent:
        seen, p = set(), parent.get(pid, 0)
        while p > 1 and p not in seen:
            if p == root:
                n += 1
                break
            seen.add(p)
            p = parent.get(p, 0)
    return n


def run(url: str, code: str, language: str = "python", **limits: object):  # type: ignore[no-untyped-def]
    return SandboxClient(url, busy_wait_s=60).run(
        RunRequest(language=language, code=code, limits=FAST.model_copy(update=limits))
    )


def test_the_service_runs_unprivileged_with_the_rlimit_fallback(service: tuple[str, int]) -> None:
    url, pid = service
    uid = int(Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0])
    assert uid != 0
    h = httpx.get(f"{url}/v1/sandbox/health").json()
    assert h["bwrap"] and h["seccomp"] is True
    assert run(url, "print('hello')").stdout == "hello\n"
    if os.geteuid() == 0:  # nobody owns no cgroup here: the slots have none (the fallback under test)
        assert h["cgroup"] is False, h


def test_hostile_subset_gives_the_same_outcomes(service: tuple[str, int]) -> None:
    url, _ = service
    bomb = run(url, "import os\nwhile True:\n    os.fork()")
    assert bomb.status in ("runtime_error", "timeout"), bomb
    assert run(url, "x = bytearray(10 * 1024**3)\nprint('allocated')").status == "memory"
    loop = run(url, "while True:\n    pass", cpu_s=1, wall_s=30)
    assert loop.status == "timeout", loop
    passwd = run(url, "print(open('/etc/passwd').read())")
    assert passwd.stdout.startswith("sandbox:") and "root:" not in passwd.stdout, passwd
    env = run(url, "env; cat /proc/*/environ 2>/dev/null", language="bash")
    assert env.status == "ok" and SECRET not in env.stdout and "LOOM_" not in env.stdout, env
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    try:
        port = listener.getsockname()[1]
        code = (
            f"import socket\ns = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('127.0.0.1', {port})))"
        )
        net = run(url, code)
        assert net.status == "ok" and net.stdout != "0\n", net
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    wrote = run(
        url, "for p in /x /etc/x /usr/x /tmp/ok; do echo x > $p 2>/dev/null && echo WROTE $p; done", "bash"
    )
    assert wrote.stdout == "WROTE /tmp/ok\n", wrote
    repo = run(url, f"import os\nprint(os.path.exists({str(REPO / 'pyproject.toml')!r}))")
    assert repo.stdout == "False\n", repo


def test_without_a_cgroup_or_slot_uids_the_fallback_holds(service: tuple[str, int]) -> None:
    """Every sandbox runs as the service's one uid: the pid namespaces keep runs and sessions apart
    (a run's ``kill -9 -1`` reaches only its own processes), RLIMIT_NPROC holds a fork bomb and the
    end of its pid namespace leaves none of its processes behind."""
    url, pid = service
    with SandboxSessionClient(url) as client, client.session(FAST) as tool:
        assert tool.run("kept = 'alive'").status == "ok"
        run(url, "print('warm')")
        baseline = settled_processes(pid)  # the slots' next sandboxes prestarted (slow under load)
        killer = run(url, "kill -9 -1; echo survived", language="bash")
        assert killer.status in ("killed", "runtime_error", "ok"), killer
        assert tool.run("kept").stdout == "'alive'\n"  # the session of the same uid was not reached
        bomb = run(url, "import os\nwhile True:\n    os.fork()")
        assert bomb.status in ("runtime_error", "timeout"), bomb
        for _ in range(300):  # a loaded machine tears a fork bomb's namespace down slowly
            if sandbox_processes(pid) <= baseline:
                break
            time.sleep(0.1)
        assert sandbox_processes(pid) <= baseline, "processes of the fork bomb outlived its run"
        assert httpx.get(f"{url}/healthz").status_code == 200
        assert tool.run("kept").stdout == "'alive'\n"


def test_the_session_tool_unprivileged(service: tuple[str, int]) -> None:
    url, _ = service
    with SandboxSessionClient(url) as client:
        with client.session(FAST) as tool:
            tool.run("n = 20")
            assert tool.run("n + 22").stdout == "42\n"
            leak = tool.run("import os\nprint(dict(os.environ), open('/etc/passwd').read())")
            assert SECRET not in leak.stdout and "root:" not in leak.stdout, leak
            r = tool.run("while True:\n    pass")
            assert r.status == "timeout" and r.session.ended == "timeout", r
            assert tool.run("n").status == "session_lost"
        with client.session(FAST) as tool:
            m = tool.run("x = bytearray(10 * 1024**3)")
            assert m.status == "memory" and m.session.ended == "memory", m
            assert tool.run("x").status == "session_lost"
        with client.session(FAST) as tool:
            assert tool.run("print('after')").stdout == "after\n"
