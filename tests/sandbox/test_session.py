"""Interpreter sessions, the sandbox as a tool (docs/sandbox.md "The sandbox as a tool"): state kept
across calls, nothing shared between sessions, each call bounded with its typed status and what the
session does after it, budgets, the idle TTL, admission, hostile cells bounded as one-shot runs are.
Real bubblewrap, rlimits, cgroups and seccomp; no stand-ins."""

from __future__ import annotations

import ast
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loom.clients.sandbox_session import SandboxSessionClient
from loom.contracts.sandbox import Limits, RunRequest, SessionLimits, SessionOpen
from sandbox_svc.pool import Busy, SandboxPool
from sandbox_svc.runner import bwrap_path
from sandbox_svc.session import SessionBusy, SessionManager, UnknownSession

pytestmark = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed (deploy/setup.sh)")

FAST = Limits(cpu_s=2, wall_s=8, memory_mb=256, processes=32, tmp_mb=8, output_bytes=64 << 10)
SECRET = "loom-test-session-token-7d2e"


@pytest.fixture(scope="module")
def sessions() -> Iterator[SessionManager]:
    old = os.environ.get("LOOM_SERVICE_TOKEN")
    os.environ["LOOM_SERVICE_TOKEN"] = SECRET  # the service's own environment holds a token
    with SessionManager(4, reap_every_s=0.1) as m:
        yield m
    if old is None:
        os.environ.pop("LOOM_SERVICE_TOKEN", None)
    else:
        os.environ["LOOM_SERVICE_TOKEN"] = old


def opened(m: SessionManager, **session: object) -> str:
    info = m.open(SessionOpen(limits=FAST, session=SessionLimits(**session)))  # type: ignore[arg-type]
    assert info.alive, info
    return info.id


def host_pid(m: SessionManager, sid: str) -> int:
    return m.get(sid).proc.popen.pid


def assert_gone(pid: int) -> None:
    for _ in range(100):
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"the session's process {pid} outlived it")


def test_state_persists_across_calls(sessions: SessionManager) -> None:
    sid = opened(sessions)
    try:
        assert sessions.call(sid, "x = 41\ndef inc(v):\n    return v + 1").status == "ok"
        r = sessions.call(sid, "import math\ninc(x)")
        assert (r.status, r.stdout) == ("ok", "42\n"), r  # a last expression's repr, as a REPL's
        r = sessions.call(sid, "open('/tmp/kept', 'w').write('tmp too')\nprint(math.floor(2.5), x)")
        assert r.stdout == "2 41\n" and r.session.calls == 3 and r.session.alive, r
        assert sessions.call(sid, "print(open('/tmp/kept').read())").stdout == "tmp too\n"
    finally:
        sessions.end(sid)


def test_an_exception_is_a_runtime_error_and_the_session_goes_on(sessions: SessionManager) -> None:
    sid = opened(sessions)
    try:
        sessions.call(sid, "y = 'kept'")
        r = sessions.call(sid, "1 / 0")
        assert r.status == "runtime_error" and r.session.alive, r
        assert "ZeroDivisionError" in r.stderr and "session_server" not in r.stderr, r
        bad = sessions.call(sid, "def (:")
        assert bad.status == "runtime_error" and "SyntaxError" in bad.stderr, bad
        ex = sessions.call(sid, "raise SystemExit(3)")
        assert ex.status == "runtime_error" and ex.session.alive, ex
        assert sessions.call(sid, "y").stdout == "'kept'\n"
    finally:
        sessions.end(sid)


def test_two_sessions_never_see_each_other(sessions: SessionManager) -> None:
    a, b = opened(sessions), opened(sessions)
    try:
        sessions.call(a, f"secret = {SECRET!r}\nopen('/tmp/a_only', 'w').write(secret)\nimport os")
        probe = (
            "import os\n"
            "print('secret' in globals(), os.listdir('/tmp'))\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        )
        r = sessions.call(b, probe)
        assert r.status == "ok" and r.stdout.startswith("False []\n"), r
        pids = ast.literal_eval(r.stdout.splitlines()[1])
        assert max(pids) < 10, r  # its own pid namespace: a's interpreter is not there to reach
        assert SECRET not in r.stdout
        killer = sessions.call(b, "import os, signal\nos.kill(-1, signal.SIGKILL)")
        assert killer.status in ("killed", "runtime_error", "ok"), killer
        assert sessions.call(a, "print(secret == open('/tmp/a_only').read())").stdout == "True\n"
        if sessions.get(a).slot.uid is not None:
            assert sessions.get(a).slot.uid != sessions.get(b).slot.uid
    finally:
        sessions.end(a)
        sessions.end(b)


def test_a_call_past_its_cpu_time_ends_the_session_and_the_next_says_so(sessions: SessionManager) -> None:
    sid = opened(sessions)
    pid = host_pid(sessions, sid)
    sessions.call(sid, "z = 1")
    r = sessions.call(sid, "while True:\n    pass")
    assert r.status == "timeout" and not r.session.alive and r.session.ended == "timeout", r
    assert_gone(pid)
    nxt = sessions.call(sid, "z")
    assert nxt.status == "session_lost" and "timeout" in (nxt.detail or ""), nxt
    assert sessions.end(sid).ended == "timeout"  # closing an ended session keeps its reason


def test_a_call_past_its_wall_time_ends_the_session(sessions: SessionManager) -> None:
    sid = opened(sessions)
    m = sessions.open(SessionOpen(limits=FAST.model_copy(update={"wall_s": 1}), session=SessionLimits()))
    try:
        r = sessions.call(m.id, "import time\ntime.sleep(60)")
        assert r.status == "timeout" and r.session.ended == "timeout", r
        assert sessions.call(m.id, "1").status == "session_lost"
        assert sessions.call(sid, "print('other session fine')").stdout == "other session fine\n"
    finally:
        sessions.end(sid)


def test_memory_ends_the_session_with_a_memory_status(sessions: SessionManager) -> None:
    for code in ("x = bytearray(10 * 1024**3)", "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"):
        sid = opened(sessions)
        pid = host_pid(sessions, sid)
        r = sessions.call(sid, code)
        assert r.status == "memory" and r.session.ended == "memory", r
        assert_gone(pid)
        assert sessions.call(sid, "x").status == "session_lost"


def test_output_past_the_limit_ends_the_session(sessions: SessionManager) -> None:
    sid = opened(sessions)
    r = sessions.call(sid, "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)")
    assert r.status == "output_limit" and r.truncated and len(r.stdout) <= FAST.output_bytes, r
    assert r.session.ended == "output_limit"
    assert sessions.call(sid, "1").status == "session_lost"


def test_session_budgets_end_it(sessions: SessionManager) -> None:
    sid = opened(sessions, max_calls=2)
    assert sessions.call(sid, "a = 1").session.alive
    last = sessions.call(sid, "a")
    assert last.status == "ok" and last.stdout == "1\n" and last.session.ended == "max_calls", last
    assert sessions.call(sid, "a").status == "session_lost"
    wall = opened(sessions, wall_budget_s=1.5)
    assert sessions.call(wall, "import time\ntime.sleep(1)").session.alive
    spent = sessions.call(wall, "time.sleep(5)")
    assert spent.status == "timeout" and spent.session.ended == "wall_budget", spent
    cpu = sessions.open(
        SessionOpen(
            limits=FAST.model_copy(update={"cpu_s": 5, "wall_s": 60}), session=SessionLimits(cpu_budget_s=1)
        )
    )
    burnt = sessions.call(cpu.id, "while True:\n    pass")
    assert burnt.status == "timeout" and burnt.session.ended == "cpu_budget", burnt
    assert burnt.session.cpu_s >= 1.0, burnt


def test_an_idle_session_is_reaped_at_its_ttl(sessions: SessionManager) -> None:
    sid = opened(sessions, idle_ttl_s=0.5)
    pid = host_pid(sessions, sid)
    for _ in range(100):
        if not sessions.get(sid).info().alive:
            break
        time.sleep(0.1)
    assert sessions.get(sid).info().ended == "idle_ttl"
    assert_gone(pid)
    r = sessions.call(sid, "1")
    assert r.status == "session_lost" and "idle_ttl" in (r.detail or ""), r
    with pytest.raises(UnknownSession):
        sessions.call("no-such-session", "1")


def test_admission_refuses_past_the_session_limit() -> None:
    with SessionManager(2) as m:
        a, b = opened(m), opened(m)
        with pytest.raises(Busy):
            m.open(SessionOpen(limits=FAST))
        assert m.health()["refused"] == 1 and m.health()["live"] == 2
        m.end(a)
        c = opened(m)
        assert m.call(c, "print('room again')").stdout == "room again\n"
        assert m.call(b, "print('b still')").stdout == "b still\n"


def test_a_call_while_one_runs_is_refused(sessions: SessionManager) -> None:
    sid = opened(sessions)
    try:
        t = threading.Thread(target=sessions.call, args=(sid, "import time\ntime.sleep(2)"))
        t.start()
        for _ in range(100):
            if sessions.get(sid).in_call:
                break
            time.sleep(0.02)
        with pytest.raises(SessionBusy):
            sessions.call(sid, "1")
        t.join(30)
        assert sessions.call(sid, "print('after')").stdout == "after\n"
    finally:
        sessions.end(sid)


def test_a_call_while_the_session_ends_is_lost_not_busy(sessions: SessionManager) -> None:
    """The reaper ends a session and cleans up holding its call lock: a call in that moment answers
    ``session_lost`` with the reason (a client retrying on ``busy`` would wait for nothing)."""
    sid = opened(sessions)
    s = sessions.get(sid)
    assert s._call_lock.acquire(blocking=False)  # the clean-up's hold, as the reaper's end takes it
    try:
        assert s.end("idle_ttl")
        r = sessions.call(sid, "1")
        assert r.status == "session_lost" and "idle_ttl" in (r.detail or ""), r
    finally:
        s._call_lock.release()
    assert sessions.call(sid, "1").status == "session_lost"  # this call's clean-up frees the slot
    assert s._cleaned


def test_a_killed_session_process_is_reported(sessions: SessionManager) -> None:
    sid = opened(sessions)
    os.kill(host_pid(sessions, sid), signal.SIGKILL)  # between calls
    time.sleep(0.5)
    r = sessions.call(sid, "1")
    assert r.status == "session_lost" and r.session.ended == "killed", r
    during = opened(sessions)
    pid = host_pid(sessions, during)
    threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
    r = sessions.call(during, "import time\ntime.sleep(30)")
    assert r.status == "killed" and r.session.ended == "killed", r


def test_hostile_cells_are_bounded_as_one_shot_runs(sessions: SessionManager) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    sid = opened(sessions)
    try:
        r = sessions.call(sid, "print(open('/etc/passwd').read())")
        assert r.stdout.startswith("sandbox:") and "root:" not in r.stdout, r
        env = sessions.call(
            sid,
            "import os\nprint(dict(os.environ))\n"
            "for p in os.listdir('/proc'):\n    if p.isdigit():\n"
            "        try: print(open(f'/proc/{p}/environ').read())\n        except OSError: pass\n",
        )
        assert env.status == "ok" and SECRET not in env.stdout and "LOOM_" not in env.stdout, env
        net = sessions.call(
            sid,
            "import socket\ns = socket.socket()\ns.settimeout(2)\n"
            f"print(s.connect_ex(('127.0.0.1', {port})))",
        )
        assert net.status == "ok" and net.stdout != "0\n", net
        with pytest.raises(TimeoutError):
            listener.accept()
        wrote = sessions.call(
            sid,
            "for p in ['/x', '/etc/x', '/usr/x', '/proc/x']:\n"
            "    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n"
            "    except OSError:\n        pass\n",
        )
        assert wrote.status == "ok" and "WROTE" not in wrote.stdout, wrote
        bomb = sessions.call(sid, "import os\nwhile True:\n    os.fork()")
        assert bomb.status in ("runtime_error", "timeout", "killed"), bomb
        if bomb.session.alive:  # the forks failed at the process limit; the interpreter goes on
            assert sessions.call(sid, "print('after the bomb')").stdout == "after the bomb\n"
    finally:
        listener.close()
        sessions.end(sid)
    fresh = opened(sessions)
    assert sessions.call(fresh, "print(6 * 7)").stdout == "42\n"  # the service survived
    sessions.end(fresh)
    with SandboxPool(1, queue_size=2) as pool:  # and one-shot runs beside sessions
        assert pool.submit(RunRequest(code="print('one-shot')", limits=FAST)).result().stdout == "one-shot\n"


def test_cells_in_one_fresh_session_the_queue_form(sessions: SessionManager) -> None:
    out = sessions.run_cells(SessionOpen(limits=FAST), ["n = 5", "n * 2", "while True: pass", "n"])
    assert [r.status for r in out] == ["ok", "ok", "timeout", "session_lost"], out
    assert out[1].stdout == "10\n" and out[2].session.ended == "timeout", out
    assert out[0].session.id not in {s for s in sessions._live}  # closed at the end


def test_sessions_over_http_with_the_typed_client(sandbox_url: str) -> None:
    with SandboxSessionClient(sandbox_url, busy_wait_s=0) as client:
        with client.session(FAST) as tool:
            assert tool.run("v = [1, 2]").status == "ok"
            r = tool.run("v + [3]")
            assert (r.status, r.stdout) == ("ok", "[1, 2, 3]\n") and r.session.calls == 2, r
            with client.session(FAST) as other:
                assert other.run("v").status == "runtime_error"
                full = client.session(FAST)  # the service allows two (conftest)
                assert not full.info.alive and full.info.ended == "sandbox_error"
                assert full.run("1").status == "sandbox_error"
                busy = httpx.post(f"{sandbox_url}/v1/sessions", json={})
                assert busy.status_code == 429 and busy.json()["error"] == "busy", busy.text
        assert tool.run("v").status == "session_lost"  # closed when its block ended
        gone = httpx.post(f"{sandbox_url}/v1/sessions/nope/run", json={"code": "1"})
        assert gone.status_code == 404 and gone.json()["error"] == "unknown_session"
        bad = httpx.post(f"{sandbox_url}/v1/sessions", json={"limits": {"wall_s": -1}})
        assert bad.status_code == 422 and "wall_s" in bad.text
        assert httpx.get(f"{sandbox_url}/v1/sessions").json()["live"] == 0
    unreachable = SandboxSessionClient("http://127.0.0.1:9", retries=0, busy_wait_s=0).session()
    assert unreachable.run("1").status == "sandbox_error"
