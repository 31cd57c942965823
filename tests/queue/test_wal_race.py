"""Several Loom processes starting at once open the same fresh SQLite files (results and embedded
broker); switching a file to WAL must not fail with 'database is locked' for any of them."""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
from pathlib import Path


def _open_results(data_dir: str, barrier: mp.synchronize.Barrier, errors: mp.Queue) -> None:
    try:
        from loom.contracts.settings import Settings
        from loom.queue import make_celery

        app = make_celery("reward", Settings(data_dir=Path(data_dir)))
        barrier.wait()
        assert app.backend.path  # opening the result store creates the file and switches it to WAL
    except Exception as exc:  # reported to the parent
        errors.put(f"{type(exc).__name__}: {exc}")


def _open_broker(path: str, barrier: mp.synchronize.Barrier, errors: mp.Queue) -> None:
    try:
        from loom.embedded_broker import set_wal

        barrier.wait()
        conn = sqlite3.connect(path, timeout=30)
        set_wal(conn)
        conn.close()
    except Exception as exc:
        errors.put(f"{type(exc).__name__}: {exc}")


def _race(target, arg: str, n: int = 8) -> list[str]:
    ctx = mp.get_context("fork")
    barrier, errors = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(arg, barrier, errors)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    out = []
    while not errors.empty():
        out.append(errors.get())
    assert all(p.exitcode == 0 for p in procs)
    return out


def test_processes_opening_a_fresh_results_file_together_all_get_wal(tmp_path):
    assert _race(_open_results, str(tmp_path)) == []
    mode = sqlite3.connect(tmp_path / "results.sqlite").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_processes_switching_a_fresh_broker_file_together_all_succeed(tmp_path):
    path = tmp_path / "broker.sqlite"
    assert _race(_open_broker, str(path)) == []
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
