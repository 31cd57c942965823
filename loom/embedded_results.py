"""Celery result backend of the embedded default: one SQLite file (WAL), one row per key.

Celery's ``db+sqlite`` backend goes through SQLAlchemy's ORM for every state change (STARTED,
SUCCESS) and every ``ready()`` poll; on this kind of machine that was about half of a task's round
trip (``loom bench broker``). Celery's ``file://`` backend is faster but rewrites result files in
place, so a reader can see half a result. This backend is Celery's key-value backend over plain
``sqlite3``: a write is one atomic upsert (a reader sees the old value or the new one), WAL mode with
``synchronous=NORMAL`` (durable across process crashes, as the embedded broker), one connection per
process and thread. Every SQLite call holds ``loom.embedded_broker.SQLITE_LOCK`` (no fork lands
inside one); a connection inherited through a fork is never used or closed in the child.

URL: ``loom.embedded_results:SQLiteBackend+sqlite:///<path>`` (four slashes before an absolute path;
built by ``loom.queue.result_backend_url``; the part before ``+`` is the backend class for Celery).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from celery.backends.base import KeyValueStoreBackend
from celery.exceptions import ImproperlyConfigured

from loom.embedded_broker import SQLITE_LOCK, set_wal

BACKEND_CLASS = "loom.embedded_results:SQLiteBackend"
SCHEME = "sqlite:///"
BUSY_TIMEOUT_S = 30.0
_INHERITED: list[sqlite3.Connection] = []  # parents' connections a forked child keeps but never touches

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS loom_results"
    " (key BLOB PRIMARY KEY, value BLOB NOT NULL, updated REAL NOT NULL)"
)


def backend_url(path: str) -> str:
    return f"{BACKEND_CLASS}+{SCHEME}{path}"


class SQLiteBackend(KeyValueStoreBackend):
    supports_autoexpire = False
    # implements_incr stays False: Celery then joins chords by polling, which this backend supports.

    def __init__(self, url: str | None = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not url or not url.startswith(SCHEME):
            raise ImproperlyConfigured(f"SQLiteBackend needs a URL {SCHEME}<absolute path>, got {url!r}")
        self.url = url
        self.path = url[len(SCHEME) :]
        self._local = threading.local()
        with SQLITE_LOCK:
            self._connect()  # fail fast on a bad path; creates the table

    def __reduce__(self, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return super().__reduce__(args, {**(kwargs or {}), "url": self.url})

    def _connect(self) -> sqlite3.Connection:
        """This thread's connection (a new one after a fork: SQLite connections must not cross it).
        Call with SQLITE_LOCK held."""
        held = getattr(self._local, "conn", None)
        if held is not None:
            if held[0] == os.getpid():
                return held[1]  # type: ignore[no-any-return]
            _INHERITED.append(held[1])  # closing it here could disturb the parent's file locks
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        set_wal(conn)
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(_SCHEMA)
        self._local.conn = (os.getpid(), conn)
        return conn

    def get(self, key: bytes) -> Any:
        with SQLITE_LOCK:
            conn = self._connect()
            row = conn.execute("SELECT value FROM loom_results WHERE key = ?", (bytes(key),)).fetchone()
        return None if row is None else row[0]

    def mget(self, keys: Iterable[bytes]) -> Iterator[Any]:
        keys = [bytes(k) for k in keys]
        found: dict[bytes, Any] = {}
        for i in range(0, len(keys), 500):  # SQLite's bound-parameter limit
            part = keys[i : i + 500]
            marks = ",".join("?" * len(part))
            with SQLITE_LOCK:
                rows = self._connect().execute(
                    f"SELECT key, value FROM loom_results WHERE key IN ({marks})", part
                )
                found.update((bytes(k), v) for k, v in rows.fetchall())
        return iter([found.get(k) for k in keys])

    def data_version(self) -> int:
        """Changes when another connection commits (``PRAGMA data_version``): a waiter's cheap check that
        something may have become ready (loom.results.ResultWaiter), no table read."""
        with SQLITE_LOCK:
            return int(self._connect().execute("PRAGMA data_version").fetchone()[0])

    def set(self, key: bytes, value: Any) -> None:
        self._write(
            "INSERT INTO loom_results (key, value, updated) VALUES (?, ?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated = excluded.updated",
            (bytes(key), value, time.time()),
        )

    def _write(self, sql: str, params: tuple[Any, ...]) -> None:
        with SQLITE_LOCK:
            self._connect().execute(sql, params)

    def delete(self, key: bytes) -> None:
        self._write("DELETE FROM loom_results WHERE key = ?", (bytes(key),))

    def expire(self, key: bytes, value: int) -> None:
        """Expiry is by age in ``cleanup`` (``result_expires``), not per key."""

    def cleanup(self) -> None:
        if self.expires:
            cutoff = time.time() - float(self.expires)
            self._write("DELETE FROM loom_results WHERE updated < ?", (cutoff,))
