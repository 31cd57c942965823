"""The hostile matrix (docs/sandbox.md "Threat model"): each hostile program is bounded by its limit
with its typed status, nothing of the service leaks in, nothing of the run outlives it, and the pool
and the other runs survive. Real bubblewrap, real rlimits and cgroups; no stand-ins."""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loom.contracts.sandbox import Limits, RunRequest
from sandbox_svc.pool import Busy, SandboxPool
from sandbox_svc.runner import bwrap_path

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed (deploy/setup.sh)")

FAST = Limits(cpu_s=2, wall_s=4, memory_mb=256, processes=32, tmp_mb=8, output_bytes=64 << 10)
SECRET = "loom-test-service-token-4f1c9e"


@pytest.fixture(scope="module")
def pool() -> Iterator[SandboxPool]:
    old = os.environ.get("LOOM_SERVICE_TOKEN")
    os.environ["LOOM_SERVICE_TOKEN"] = SECRET  # the service's own environment holds a token
    with SandboxPool(2, queue_size=16) as p:
        yield p
    if old is None:
        os.environ.pop("LOOM_SERVICE_TOKEN", None)
    else:
        os.environ["LOOM_SERVICE_TOKEN"] = old


def run(pool: SandboxPool, code: str, language: str = "python", stdin: str = "", **limits: object):
    return pool.submit(
        RunRequest(language=language, code=code, stdin=stdin, limits=FAST.model_copy(update=limits))
    ).result()


def _status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":", 1) for line in lines if ":" in line)


def uid_processes(pool: SandboxPool) -> list[int]:
    """Host pids run by the pool's slot uids, less the warm sandboxes waiting for the next run."""
    uids = pool.slot_uids()
    warm = {r.slot.warm.proc.pid for r in pool._runners if r.slot.warm is not None}
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        st = _status(int(d.name))
        if not st or int(st["Uid"].split()[0]) not in uids:
            continue
        pid, chain = int(d.name), set()
        while pid > 1 and pid not in chain:
            chain.add(pid)
            pid = int(_status(pid).get("PPid", "0").strip() or 0)
        if not chain & warm:
            out.append(int(d.name))
    return out


def assert_nothing_left(pool: SandboxPool) -> None:
    for _ in range(300):  # up to 30 s: the kernel's kills and reaping lag on a loaded host
        left = uid_processes(pool)
        if not left:
            return
        time.sleep(0.1)
    states = {
        pid: (_status(pid).get("State", "").strip(), _status(pid).get("Name", "").strip()) for pid in left
    }
    raise AssertionError(f"processes of the run outlived it: {states}")


def assert_pool_works(pool: SandboxPool) -> None:
    r = run(pool, "print(sum(range(10)))")
    assert (r.status, r.stdout) == ("ok", "45\n"), r


def test_ok_program_reads_stdin_and_exits_zero(pool: SandboxPool) -> None:
    r = run(pool, "import sys\nprint(sys.stdin.read().upper(), end='')", stdin="abc\n")
    assert (r.status, r.exit_code, r.stdout) == ("ok", 0, "ABC\n")
    b = run(pool, "echo $((6*7)); exit 3", language="bash")
    assert (b.status, b.exit_code, b.stdout) == ("runtime_error", 3, "42\n")


def test_fork_bomb_is_bounded_by_the_process_limit(pool: SandboxPool) -> None:
    r = run(pool, "import os\nwhile True:\n    os.fork()")
    assert r.status in ("runtime_error", "timeout"), r
    b = run(pool, ":(){ :|:& };:\nsleep 10", language="bash")
    assert b.status == "timeout", b
    assert_nothing_left(pool)
    assert_pool_works(pool)


def test_ten_gigabytes_is_a_memory_outcome(pool: SandboxPool) -> None:
    r = run(pool, "x = bytearray(10 * 1024**3)\nprint('allocated')")
    assert r.status == "memory" and "allocated" not in r.stdout, r
    touched = run(pool, "x = []\nwhile True:\n    x.append(bytearray(16 << 20))")
    assert touched.status == "memory", touched
    assert_pool_works(pool)


def test_infinite_loop_is_a_timeout(pool: SandboxPool) -> None:
    r = run(pool, "while True:\n    pass", cpu_s=1, wall_s=30)
    assert r.status == "timeout" and r.signal == signal.SIGXCPU, r
    w = run(pool, "import time\ntime.sleep(60)", wall_s=1)
    assert w.status == "timeout" and w.exit_code is None, w


def test_busy_child_outliving_its_parent_is_killed_with_the_run(pool: SandboxPool) -> None:
    code = "import os\nif os.fork() == 0:\n    while True:\n        pass\nprint('parent done')"
    r = run(pool, code)
    assert (r.status, r.stdout) == ("ok", "parent done\n"), r
    assert_nothing_left(pool)


def test_nothing_outside_tmp_is_writable(pool: SandboxPool) -> None:
    code = (
        "import os\n"
        "for p in ['/x', '/etc/x', '/usr/x', '/code/x', '/proc/x', '/dev/x', '/bin/x']:\n"
        "    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('refused', p)\n"
        "open('/tmp/ok', 'w').write('x')\nprint('tmp ok')\n"
    )
    r = run(pool, code)
    assert r.status == "ok" and "WROTE" not in r.stdout and "tmp ok" in r.stdout, r


def test_filling_the_disk_stops_at_the_tmp_size(pool: SandboxPool) -> None:
    code = (
        "n = 0\nf = open('/tmp/fill', 'wb')\n"
        "try:\n    while True:\n        f.write(b'x' * (1 << 20)); f.flush(); n += 1\n"
        "except OSError as e:\n    print('stopped', n, e.errno)\n"
    )
    r = run(pool, code, tmp_mb=4)
    assert r.status in ("ok", "runtime_error"), r
    if r.status == "ok":
        assert int(r.stdout.split()[1]) <= 4, r
    else:  # RLIMIT_FSIZE's SIGXFSZ ended it first
        assert r.signal == signal.SIGXFSZ, r


def test_etc_passwd_is_the_sandbox_stub(pool: SandboxPool) -> None:
    r = run(pool, "print(open('/etc/passwd').read())")
    assert r.status == "ok" and "root:" not in r.stdout and r.stdout.startswith("sandbox:"), r
    host = Path("/etc/passwd").read_text()
    assert host.splitlines()[0] not in r.stdout


def test_the_service_environment_is_not_visible(pool: SandboxPool) -> None:
    code = (
        "import os\nprint(dict(os.environ))\n"
        "for p in os.listdir('/proc'):\n"
        "    if p.isdigit():\n"
        "        try: print(open(f'/proc/{p}/environ').read())\n"
        "        except OSError: pass\n"
    )
    r = run(pool, code)
    assert r.status == "ok" and SECRET not in r.stdout and "LOOM_" not in r.stdout, r
    b = run(pool, "env; cat /proc/*/environ 2>/dev/null", language="bash")
    assert SECRET not in b.stdout and "LOOM_" not in b.stdout, b


def test_data_dir_policy_store_and_repo_are_absent(pool: SandboxPool, tmp_path: Path) -> None:
    data = tmp_path / "data" / "policy"
    data.mkdir(parents=True)
    (data / "manifest.json").write_text("weights")
    repo = Path(__file__).resolve().parents[2]
    code = (
        "import os\n"
        f"for p in [{str(data / 'manifest.json')!r}, {str(repo / 'pyproject.toml')!r},\n"
        "          '/root', '/work', '/home']:\n"
        "    print(p, os.path.exists(p))\n"
    )
    r = run(pool, code)
    assert r.status == "ok" and "True" not in r.stdout, r


def test_no_network_to_loopback_or_outward(pool: SandboxPool) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    code = (
        "import socket, os\n"
        f"s = socket.socket()\ns.settimeout(2)\nprint('loopback', s.connect_ex(('127.0.0.1', {port})))\n"
        "print('routes', open('/proc/net/route').read().count(chr(10)) - 1)\n"
        "try:\n    socket.getaddrinfo('example.com', 80)\n    print('RESOLVED')\n"
        "except OSError:\n    print('no dns')\n"
    )
    r = run(pool, code)
    try:
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing reached the host's loopback
    finally:
        listener.close()
    assert r.status == "ok", r
    assert "loopback 0" not in r.stdout and "routes 0" in r.stdout and "no dns" in r.stdout, r


def test_killing_the_runner_is_a_killed_outcome(pool: SandboxPool) -> None:
    with SandboxPool(1, queue_size=4) as one:
        fut = one.submit(
            RunRequest(code="import time\ntime.sleep(30)", limits=FAST.model_copy(update={"wall_s": 30}))
        )
        runner = one._runners[0]
        for _ in range(100):
            if runner.slot.pid is not None:
                break
            time.sleep(0.05)
        os.kill(runner.slot.pid, signal.SIGKILL)
        r = fut.result(timeout=20)
        assert r.status == "killed", r
        assert one.submit(RunRequest(code="print('next')", limits=FAST)).result().stdout == "next\n"
    inside = run(pool, "kill -9 -1; echo survived", language="bash")
    assert inside.status in ("killed", "runtime_error", "ok"), inside
    assert_pool_works(pool)


PTRACE = (
    "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "print('attach', libc.ptrace(16, {pid}, 0, 0), ctypes.get_errno())\n"
    "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
)


def test_ptrace_reaches_nothing_outside(pool: SandboxPool) -> None:
    r = run(pool, PTRACE.format(pid=os.getpid()))
    assert r.status == "ok" and "attach -1 1\n" in r.stdout, r  # EPERM: seccomp refuses ptrace itself
    pids = ast.literal_eval(r.stdout.split("pids ", 1)[1])
    assert max(pids) < 10, r  # its own pid namespace: bwrap's init and the program


def test_seccomp_refuses_namespaces_and_tracing_but_not_processes(pool: SandboxPool) -> None:
    code = (
        "import ctypes, os, subprocess, threading, multiprocessing as mp\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
        "print('traceme', libc.ptrace(0, 0, 0, 0), ctypes.get_errno())\n"
        "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
        "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, end='')\n"
        "with mp.Pool(2) as p:\n    print('pool', p.map(abs, [-1, -2]))\n"
    )
    r = run(pool, code)
    assert pool.health()["seccomp"] is True
    assert r.status == "ok", r
    assert "unshare -1 1\n" in r.stdout and "traceme -1 1\n" in r.stdout, r
    assert "thread\nchild\npool [1, 2]\n" in r.stdout, r


def test_a_gigabyte_of_output_is_cut_at_the_output_limit(pool: SandboxPool) -> None:
    r = run(pool, "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)")
    assert r.status == "output_limit" and r.truncated and len(r.stdout) <= FAST.output_bytes, r
    b = run(pool, "yes", language="bash")
    assert b.status == "output_limit", b
    assert_nothing_left(pool)


def test_a_program_that_never_reads_stdin_is_not_blocked(pool: SandboxPool) -> None:
    r = run(pool, "print('done')", stdin="y" * (8 << 20))
    assert (r.status, r.stdout) == ("ok", "done\n"), r


def test_the_next_run_on_a_warm_slot_sees_nothing_of_the_last() -> None:
    with SandboxPool(1, queue_size=4) as one:
        first = RunRequest(
            language="bash",
            code="echo secret > /tmp/left; (sleep 100 &) ; export X=1; echo started",
            limits=FAST,
        )
        assert one.submit(first).result().stdout == "started\n"
        second = RunRequest(
            code="import os\nprint(os.listdir('/tmp'), [p for p in os.listdir('/proc') if p.isdigit()])",
            limits=FAST,
        )
        r = one.submit(second).result()
        assert r.status == "ok" and "left" not in r.stdout, r
        assert len(ast.literal_eval(r.stdout.split("] ", 1)[1])) <= 2, r
        assert_nothing_left(one)


def test_one_bad_program_never_fails_its_batch(pool: SandboxPool) -> None:
    batch = [
        RunRequest(code="print(1)", limits=FAST),
        RunRequest(code="import os\nwhile True: os.fork()", limits=FAST),
        RunRequest(code="while True: pass", limits=FAST.model_copy(update={"cpu_s": 1})),
        RunRequest(code="raise SystemExit(2)", limits=FAST),
        RunRequest(code="print(2)", limits=FAST),
    ]
    out = pool.run_batch(batch)
    assert [r.status for r in out][0::4] == ["ok", "ok"] and out[3].exit_code == 2
    assert out[2].status == "timeout"


def test_a_full_pool_answers_busy_instead_of_queueing() -> None:
    with SandboxPool(1, queue_size=1) as one:
        slow = RunRequest(code="import time\ntime.sleep(2)", limits=FAST)
        held = one.submit_many([slow, slow])
        with pytest.raises(Busy):
            one.submit(slow)
        assert [f.result().status for f in held] == ["ok", "ok"]
        assert one.health()["refused"] == 1
        assert one.submit(RunRequest(code="print(3)", limits=FAST)).result().stdout == "3\n"


def test_limits_are_capped_at_the_service_maximum() -> None:
    with SandboxPool(1, max_limits=FAST) as one:
        r = one.submit(RunRequest(code="import time\ntime.sleep(30)", limits=Limits(wall_s=60))).result()
        assert r.status == "timeout", r  # capped at 4 s: under the asked 60 the sleep of 30 would end ok
    threading.enumerate()  # the pool's threads ended with it


@pytest.fixture(scope="module")
def rlimit_pool() -> Iterator[SandboxPool]:
    """A pool without cgroups or seccomp: what a host that allows neither gets (namespaces and rlimits)."""
    with SandboxPool(1, queue_size=4, use_cgroup=False, use_seccomp=False) as p:
        assert p.health()["cgroup"] is False and p.health()["seccomp"] is False
        yield p


def test_without_a_cgroup_rlimits_bound_forks_memory_and_leftovers(rlimit_pool: SandboxPool) -> None:
    bomb = run(rlimit_pool, "import os\nwhile True:\n    os.fork()")
    assert bomb.status in ("runtime_error", "timeout"), bomb
    assert run(rlimit_pool, "x = bytearray(10 * 1024**3)").status == "memory"
    child = run(rlimit_pool, "import os\nif os.fork() == 0:\n    while True:\n        pass\nprint('parent')")
    assert child.status == "ok"
    assert_nothing_left(rlimit_pool)
    fut = rlimit_pool.submit(RunRequest(language="bash", code="(sleep 60 &); sleep 60", limits=FAST))
    runner = rlimit_pool._runners[0]
    for _ in range(100):
        if runner.slot.pid is not None:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(runner.slot.pid, signal.SIGKILL)  # type: ignore[arg-type]
    assert fut.result(timeout=20).status == "killed"
    assert_nothing_left(rlimit_pool)  # the slot's uid was swept
    assert_pool_works(rlimit_pool)
    traced = run(rlimit_pool, PTRACE.format(pid=os.getpid()))
    assert "attach -1 3\n" in traced.stdout, traced  # without seccomp: ESRCH, the host's pid is not there


FREEZER = Path("/sys/fs/cgroup/freezer")


def test_a_stuck_runner_is_replaced_and_its_run_reported() -> None:
    """A runner that stops answering (its bwrap frozen by the cgroup freezer: SIGKILL waits until it
    thaws, as for a process stuck in the kernel) is replaced by the health check: its run is answered
    ``killed``, not lost, and the next run goes to a fresh slot."""
    frozen = FREEZER / f"loom-test-{os.getpid()}"
    try:
        frozen.mkdir()
    except OSError:
        pytest.skip("no writable cgroup v1 freezer on this host")
    try:
        with SandboxPool(1, queue_size=4, grace_s=1.0) as one:
            fut = one.submit(
                RunRequest(code="import time\ntime.sleep(30)", limits=FAST.model_copy(update={"wall_s": 1}))
            )
            runner = one._runners[0]
            for _ in range(100):
                if runner.slot.pid is not None:
                    break
                time.sleep(0.05)
            (frozen / "cgroup.procs").write_text(str(runner.slot.pid))
            (frozen / "freezer.state").write_text("FROZEN")
            r = fut.result(timeout=30)
            assert r.status == "killed" and "replaced" in (r.detail or ""), r
            assert one.health()["replaced"] == 1 and one._runners[0] is not runner
            (frozen / "freezer.state").write_text("THAWED")
            assert_pool_works(one)
            runner.thread.join(10)
            assert not runner.thread.is_alive()
    finally:
        (frozen / "freezer.state").write_text("THAWED")
        for _ in range(50):
            try:
                frozen.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_program_that_closes_its_output_still_times_out_at_the_wall(pool: SandboxPool) -> None:
    r = run(pool, "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(60)", wall_s=1)
    assert r.status == "timeout", r  # the runner's clock, not the health check (killed)
    assert_pool_works(pool)


def test_groups_left_by_a_killed_sandbox_process_are_swept() -> None:
    from sandbox_svc.cgroups import make_group, sweep_stale

    dead = subprocess.Popen(["true"])
    dead.wait()
    group = make_group(f"loom-sandbox-{dead.pid}-0-0")
    if group is None:
        pytest.skip("no writable cgroup on this host")
    mine = make_group(f"loom-sandbox-{os.getpid()}-test-0")
    assert mine is not None
    try:
        assert sweep_stale() >= 1
        assert not any(d.exists() for d in group.dirs.values())
        assert all(d.exists() for d in mine.dirs.values())  # a live process's groups stay
    finally:
        mine.remove()
        group.remove()
