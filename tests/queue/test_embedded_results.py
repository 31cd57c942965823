"""The embedded result backend (loom/embedded_results.py): Celery's key-value API over one SQLite file."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
from celery.exceptions import ImproperlyConfigured

from loom.contracts.settings import Settings
from loom.embedded_results import SQLiteBackend
from loom.queue import make_celery


def _app(tmp_path):
    return make_celery("reward", Settings(data_dir=tmp_path))


def test_embedded_default_uses_it_and_round_trips_states(tmp_path):
    app = _app(tmp_path)
    backend = app.backend
    assert isinstance(backend, SQLiteBackend)
    assert backend.path == str((tmp_path / "results.sqlite").resolve())
    assert app.AsyncResult("missing").state == "PENDING"
    backend.store_result("t1", None, "STARTED")
    assert app.AsyncResult("t1").state == "STARTED"
    backend.store_result("t1", {"ok": [1, 2]}, "SUCCESS")
    res = app.AsyncResult("t1")
    assert res.ready() and res.result == {"ok": [1, 2]}
    backend.mark_as_failure("t2", ValueError("bad input"))
    assert app.AsyncResult("t2").state == "FAILURE"
    assert isinstance(app.AsyncResult("t2").result, ValueError)
    keys = [backend.get_key_for_task(t) for t in ("t1", "nope", "t2")]
    got = list(backend.mget(keys))
    assert got[1] is None and "SUCCESS" in got[0] and "FAILURE" in got[2]
    backend.forget("t1")
    assert app.AsyncResult("t1").state == "PENDING"


def test_a_second_app_on_the_same_data_dir_reads_the_results(tmp_path):
    _app(tmp_path).backend.store_result("shared", 42, "SUCCESS")
    assert _app(tmp_path).AsyncResult("shared").get(timeout=5) == 42


def test_cleanup_removes_results_older_than_result_expires(tmp_path):
    app = _app(tmp_path)
    backend = app.backend
    backend.store_result("old", 1, "SUCCESS")
    backend.expires = 0.05
    time.sleep(0.1)
    backend.store_result("new", 2, "SUCCESS")
    backend.cleanup()
    assert app.AsyncResult("old").state == "PENDING"
    assert app.AsyncResult("new").result == 2


def test_a_bad_url_is_a_configuration_error(tmp_path):
    with pytest.raises(ImproperlyConfigured):
        SQLiteBackend(url="file:///nowhere", app=_app(tmp_path))


def _writer(data_dir: str, n: int) -> None:
    backend = make_celery("reward", Settings(data_dir=data_dir)).backend
    big = "x" * 200_000
    for i in range(n):
        backend.store_result("hot", {"i": i, "pad": big}, "PROGRESS")  # SUCCESS is never overwritten


def test_readers_never_see_a_partial_result_while_another_process_rewrites_it(tmp_path):
    app = _app(tmp_path)
    app.backend.store_result("hot", {"i": -1, "pad": ""}, "PROGRESS")
    proc = mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), 200))
    proc.start()
    seen = set()
    try:
        while proc.is_alive() or not seen:
            meta = app.backend.get_task_meta("hot", cache=False)  # decodes: a torn value would raise
            assert meta["status"] == "PROGRESS"
            seen.add(meta["result"]["i"])
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert app.backend.get_task_meta("hot", cache=False)["result"]["i"] == 199
    assert len(seen) > 1  # the reader really ran while the writer rewrote the value


_FORKS = """
import os, sys, threading, time
from pathlib import Path

from loom.contracts.settings import Settings
from loom.embedded_broker import Database
from loom.embedded_results import SQLiteBackend
from loom.queue import make_celery

tmp = Path(sys.argv[1])
db = Database.get(str(tmp / "broker.sqlite"))
backend = make_celery("reward", Settings(data_dir=tmp)).backend
stop = threading.Event()


def poll():  # what a worker's main thread does between tasks
    while not stop.is_set():
        db.execute("INSERT INTO queues (name) VALUES ('q') ON CONFLICT DO NOTHING")
        db.execute("SELECT * FROM messages WHERE queue = 'q' LIMIT 1")
        backend.get(b"k")


hung = []


def fork_children():
    for i in range(250):
        pid = os.fork()
        if pid == 0:  # a fresh child's first act: open the result store and write
            try:
                SQLiteBackend(url=backend.url, app=backend.app).set(b"child", b"1")
            finally:
                os._exit(0)
        deadline = time.monotonic() + 5
        while os.waitpid(pid, os.WNOHANG)[0] == 0:
            if time.monotonic() > deadline:
                hung.append(i)
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return  # one hung child is enough to fail
            time.sleep(0.001)


poller = threading.Thread(target=poll)
poller.start()
try:
    forker = threading.Thread(target=fork_children)
    forker.start()
    forker.join()
finally:
    stop.set()
    poller.join()
print("hung", hung, "child", backend.get(b"child"))
"""


def test_forks_from_a_thread_while_the_broker_polls_never_hang_the_child(tmp_path):
    """Celery's prefork supervisor forks replacement children from a thread while the main thread
    polls the embedded broker. Without SQLITE_LOCK about 2 % of such forks left the child hung in
    its first SQLite call (measured with raw sqlite3: 28 of 1500); with it, none may. 250 forks: a
    2 % hang rate goes unseen with probability 0.98^250 = 0.6 %. Run in a fresh interpreter, as a
    worker is: forking this test process (torch and every test module loaded) costs ~0.15 s a fork."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FORKS, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "hung [] child b'1'", done.stdout[-3000:]
