"""The embedded broker: a kombu virtual transport over one SQLite file (no server to install).

URL: ``loomsql:///<absolute path>/broker.sqlite`` (``LOOM_BROKER_URL=embedded`` selects it).

Delivery is AT LEAST ONCE, like RabbitMQ with late acknowledgement:

- ``_get`` does not delete a message; it *leases* it: ``visible_at = now + visibility_timeout`` and
  ``owner = <this channel>``. Other consumers only see rows whose ``visible_at <= now``.
- ack deletes the row; reject(requeue=True) and a graceful close (``restore_unacked``) make it visible
  again at once (it keeps its place: rows are taken in ``id`` order).
- the consuming process renews the leases of every message it holds whenever it polls (the Celery
  worker polls continuously, also while its prefetch window is full), so a long task is not
  redelivered while its worker lives;
- a SIGKILLed worker renews nothing: after ``visibility_timeout`` its messages become visible again
  and another worker gets them with ``delivery_info["redelivered"] = True``.

Every process opens its own connection; SQLite in WAL mode with a busy timeout serialises writers
across processes, and each claim is one ``UPDATE ... RETURNING`` statement, so two consumers never
lease the same message. Exchanges and bindings are stored in the file too, so a process that never
declared a queue still routes to it (as a real broker would). Messages are rows on disk: they
survive a restart of every process.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
import time
import uuid
from queue import Empty
from typing import Any

from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str

from loom import timeline

DEFAULT_VISIBILITY_TIMEOUT = 30.0
DEFAULT_POLLING_INTERVAL = 0.05
BUSY_TIMEOUT_MS = 30_000

# SQLite and fork. Celery's prefork pool forks new children from a thread (billiard's supervisor
# replaces a recycled or lost child) while the worker's main thread polls the broker. A fork that
# lands while another thread is inside SQLite copies SQLite's internal mutexes locked, and the child
# hangs forever on its first SQLite call (seen: a rollout child stuck opening the result store after
# the 200-task recycle, the demo stalled). Every SQLite call of the embedded broker and result store
# holds SQLITE_LOCK, and so does every fork of this process (os.register_at_fork), so a fork never
# happens inside one.
SQLITE_LOCK = threading.RLock()


def _fork_after() -> None:
    SQLITE_LOCK.release()  # in the child the forking thread, the only one left, is the owner


os.register_at_fork(before=SQLITE_LOCK.acquire, after_in_parent=_fork_after, after_in_child=_fork_after)

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    queue       TEXT NOT NULL,
    payload     TEXT NOT NULL,
    visible_at  REAL NOT NULL DEFAULT 0,
    owner       TEXT,
    deliveries  INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS messages_ready ON messages (queue, visible_at, id);
CREATE INDEX IF NOT EXISTS messages_owner ON messages (owner);
CREATE TABLE IF NOT EXISTS queues (name TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS bindings (
    exchange     TEXT NOT NULL,
    type         TEXT NOT NULL,
    routing_key  TEXT NOT NULL,
    queue        TEXT NOT NULL,
    PRIMARY KEY (exchange, routing_key, queue)
);
"""


def database_path(client: Any) -> str:
    """The SQLite file of a kombu connection ``loomsql:///abs/path`` (kombu puts the path in vhost)."""
    vhost = client.virtual_host or ""
    if not vhost or vhost == "/":
        raise ValueError("embedded broker URL needs a file: loomsql:///absolute/path/broker.sqlite")
    return vhost if vhost.startswith("/") else "/" + vhost


class Database:
    """One SQLite connection per process and file, shared by the process's channels under a lock.

    Acks may come from another thread than the consuming one (Celery's prefork result handler), so
    every statement runs under ``lock``. After ``fork`` a child opens its own connection.
    """

    _instances: dict[tuple[int, str], Database] = {}
    _instances_lock = threading.Lock()

    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = SQLITE_LOCK
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with self.lock:
            self.conn = sqlite3.connect(
                path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
            )
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            set_wal(self.conn)
            self.conn.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL: durable across process crashes
            self.conn.executescript(SCHEMA)

    @classmethod
    def get(cls, path: str) -> Database:
        key = (os.getpid(), path)
        with cls._instances_lock:
            db = cls._instances.get(key)
            if db is None:
                db = cls._instances[key] = cls(path)
            return db

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.conn.execute(sql, params).fetchall()

    puts = 0  # messages this process published: its own commits do not move ``data_version``

    def version(self) -> tuple[int, int]:
        """Changes when a message may have arrived: another connection committed (``PRAGMA
        data_version``, a counter read that touches no table) or this process published one. A write
        that changes nothing (an empty poll's claim) commits no page and moves no one's version."""
        with self.lock:
            return int(self.conn.execute("PRAGMA data_version").fetchone()[0]), self.puts


class QoS(virtual.QoS):
    """Acks and rejects act on the leased rows; a graceful close releases the leases."""

    def ack(self, delivery_tag: str) -> None:
        self.channel._ack(delivery_tag)
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        if requeue:
            self.channel._release(delivery_tag)
        else:
            self.channel._ack(delivery_tag)
        super().ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        self._flush()
        errors: list[Any] = []
        for tag, message in list(self._delivered.items()):
            try:
                self.channel._release(tag)
            except Exception as exc:  # keep releasing the others; the lease expires anyway
                errors.append((exc, message))
        self._delivered.clear()
        return errors

    def restore_unacked_once(self, stderr: Any = None) -> None:
        if getattr(self.channel, "_pid", None) != os.getpid():
            return  # a forked child must not release its parent's leases
        super().restore_unacked_once(stderr)


class Channel(virtual.Channel):
    QoS = QoS
    from_transport_options = (  # type: ignore[assignment]
        *virtual.Channel.from_transport_options,
        "visibility_timeout",
        "polling_interval",
    )
    visibility_timeout: float = DEFAULT_VISIBILITY_TIMEOUT
    polling_interval: float = DEFAULT_POLLING_INTERVAL

    def __init__(self, connection: Any, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.visibility_timeout = float(self.visibility_timeout)
        self._pid = os.getpid()
        self._owner = uuid.uuid4().hex
        self._no_ack_queues: set[str] = set()
        self._renewed_at = 0.0
        self.db = Database.get(database_path(self.connection.client))

    # --- queues and routing ------------------------------------------------------------------
    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self.db.execute("INSERT OR IGNORE INTO queues (name) VALUES (?)", (queue,))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self.db.execute("SELECT 1 FROM queues WHERE name = ?", (queue,)))

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        exchange = exchange or "amq.direct"
        super().queue_bind(queue, exchange, routing_key, arguments, **kwargs)
        etype = self.state.exchanges.get(exchange, {}).get("type", "direct")
        self.db.execute(
            "INSERT OR IGNORE INTO bindings (exchange, type, routing_key, queue) VALUES (?, ?, ?, ?)",
            (exchange, etype, routing_key, queue),
        )

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> None:
        if if_empty and self._size(queue):
            return
        super().queue_delete(queue, if_unused=if_unused, if_empty=if_empty, **kwargs)
        self.db.execute("DELETE FROM bindings WHERE queue = ?", (queue,))
        self.db.execute("DELETE FROM messages WHERE queue = ?", (queue,))
        self.db.execute("DELETE FROM queues WHERE name = ?", (queue,))

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        if exchange and exchange not in self.state.exchanges:
            self._load_bindings(exchange)
        return super()._lookup(exchange, routing_key, default)

    def _load_bindings(self, exchange: str) -> None:
        """Learn the bindings another process declared, so this one routes like a broker would."""
        rows = self.db.execute(
            "SELECT type, routing_key, queue FROM bindings WHERE exchange = ?", (exchange,)
        )
        if not rows:
            return
        self.exchange_declare(exchange, type=rows[0][0], durable=True)
        for _, routing_key, queue in rows:
            virtual.Channel.queue_bind(self, queue, exchange, routing_key)

    # fanout (broadcast, e.g. Celery remote control): the bound queues are read from the file
    supports_fanout = True

    def _queue_bind(self, exchange: str, routing_key: str, pattern: Any, queue: str) -> None:
        pass  # queue_bind already stored the binding

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str, **kwargs: Any) -> None:
        rows = self.db.execute("SELECT DISTINCT queue FROM bindings WHERE exchange = ?", (exchange,))
        for (queue,) in rows:
            self._put(queue, message)

    # --- messages ------------------------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.db.execute("INSERT INTO messages (queue, payload) VALUES (?, ?)", (queue, json.dumps(message)))
        self.db.puts += 1

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        self._renew_leases()
        now = time.time()
        if queue in self._no_ack_queues:
            rows = self.db.execute(
                "DELETE FROM messages WHERE id = (SELECT id FROM messages WHERE queue = ? AND visible_at <= ?"
                " ORDER BY id LIMIT 1) RETURNING id, payload, deliveries",
                (queue, now),
            )
        else:
            rows = self.db.execute(
                "UPDATE messages SET visible_at = ?, owner = ?, deliveries = deliveries + 1"
                " WHERE id = (SELECT id FROM messages WHERE queue = ? AND visible_at <= ?"
                " ORDER BY id LIMIT 1) RETURNING id, payload, deliveries",
                (now + self.visibility_timeout, self._owner, queue, now),
            )
        if not rows:
            raise Empty()
        row_id, payload, deliveries = rows[0]
        message: dict[str, Any] = json.loads(bytes_to_str(payload))
        props = message.setdefault("properties", {})
        props["delivery_tag"] = f"{self._owner}:{row_id}"
        delivery_info = props.setdefault("delivery_info", {})
        if deliveries > 1 or message.pop("redelivered", False):
            delivery_info["redelivered"] = True
        if timeline.PATH is not None:  # the task's id: when its worker claimed it (loom/timeline.py)
            timeline.mark("claim", str((message.get("headers") or {}).get("id") or ""))
        return message

    def _row_id(self, delivery_tag: str) -> int:
        return int(str(delivery_tag).rsplit(":", 1)[1])

    def _ack(self, delivery_tag: str) -> None:
        self.db.execute("DELETE FROM messages WHERE id = ?", (self._row_id(delivery_tag),))

    def _release(self, delivery_tag: str) -> None:
        """Make a held message visible again now (only if this channel still holds its lease)."""
        self.db.execute(
            "UPDATE messages SET visible_at = 0, owner = NULL WHERE id = ? AND owner = ?",
            (self._row_id(delivery_tag), self._owner),
        )

    def _renew_leases(self, force: bool = False) -> None:
        """Extend the lease of every message this channel holds (throttled to a few times per timeout)."""
        now = time.time()
        if not force and now - self._renewed_at < self.visibility_timeout / 4:
            return
        self._renewed_at = now
        if self._qos is not None and self._qos._delivered:
            self.db.execute(
                "UPDATE messages SET visible_at = ? WHERE owner = ?",
                (now + self.visibility_timeout, self._owner),
            )

    def _size(self, queue: str) -> int:
        rows = self.db.execute(
            "SELECT COUNT(*) FROM messages WHERE queue = ? AND visible_at <= ?", (queue, time.time())
        )
        return int(rows[0][0])

    def _purge(self, queue: str) -> int:
        rows = self.db.execute(
            "DELETE FROM messages WHERE queue = ? AND visible_at <= ? RETURNING id", (queue, time.time())
        )
        return len(rows)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.db.execute("DELETE FROM messages WHERE queue = ?", (queue,))

    def basic_consume(self, queue: str, no_ack: bool, *args: Any, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
        return super().basic_consume(queue, no_ack, *args, **kwargs)

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        if no_ack:
            self._no_ack_queues.add(queue)
            try:
                return super().basic_get(queue, no_ack=no_ack, **kwargs)
            finally:
                self._no_ack_queues.discard(queue)
        return super().basic_get(queue, no_ack=no_ack, **kwargs)

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        super().basic_ack(delivery_tag, multiple=multiple)
        self.connection.wake()  # the prefetch window has room: fetch the next message now

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        super().basic_reject(delivery_tag, requeue=requeue)
        self.connection.wake()

    def drain_events(self, timeout: float | None = None, callback: Any = None) -> Any:
        # Called on every poll, also while the prefetch window is full: keep our leases alive.
        self._renew_leases()
        return super().drain_events(timeout=timeout, callback=callback)


class Transport(virtual.Transport):
    Channel = Channel
    polling_interval = DEFAULT_POLLING_INTERVAL
    default_port = 0  # type: ignore[assignment]
    driver_type = "sql"
    driver_name = "sqlite"
    connection_errors = (sqlite3.OperationalError, ConnectionError)  # type: ignore[assignment]
    channel_errors = virtual.Transport.channel_errors

    implements = virtual.Transport.implements.extend(exchange_type=frozenset(["direct", "topic", "fanout"]))

    def driver_version(self) -> str:
        return sqlite3.sqlite_version

    # Waiting for a message: after an empty poll the loop sleeps until the broker file changes
    # (``Database.version``: another process committed, or this one published), checked every
    # ``change_tick`` s doubling while quiet up to ``hot_tick_max`` for ``hot_s`` seconds after a
    # delivery, else every ``idle_tick_max``, and polls again then; a full poll still runs every
    # polling interval (a lease that expired changes no page). A check is one PRAGMA under the
    # process's SQLite lock; a poll is kombu's cycle over every consumed queue, a claim statement each.
    # Before, a worker polled every 5 ms for 2 s after a delivery, else at the 50 ms idle interval: one
    # idle for longer (its queue empty while the direct leg of bench/rollout.py ran, or a trainer's
    # step) saw the next task ~25 ms late on average (docs/benchmarks: +17 % on a quick run of 0.3 s rounds
    # at 4 in flight on vLLM); now within ``idle_tick_max`` (idle, ~0.5 % of a core more than before
    # on the 2-core machine). An ack or reject in this process (the window has room again) ends the
    # wait at once; while the task window is full only that lets a task in, and the remote-control
    # queue is polled at the idle interval.
    change_tick = 0.001
    hot_tick_max = 0.004
    idle_tick_max = 0.016
    hot_s = 2.0
    _idle_interval: float | None = None
    _last_delivery = 0.0
    _wake_event: threading.Event | None = None

    def wake(self) -> None:
        if self._wake_event is not None:
            self._wake_event.set()

    def _version(self) -> tuple[int, int] | None:
        channels = self.channels
        return channels[0].db.version() if channels else None

    def drain_events(self, connection: Any, timeout: float | None = None) -> Any:  # type: ignore[override]
        """kombu's polling loop (``virtual.Transport.drain_events``) with a sleep that ends when the
        broker file changes or this process acks, and polling at the idle interval while the task
        window is full (``_windows_full``). Returns on a delivery; raises ``socket.timeout`` after
        ``timeout``, capped at one second: Celery's synchronous loop checks for shutdown between
        calls, so a SIGTERM'd worker exits promptly."""
        if self._idle_interval is None:
            self._idle_interval = float(self.polling_interval)  # the configured one (transport options)
        idle = self._idle_interval
        if self._wake_event is None:
            self._wake_event = threading.Event()
        wake = self._wake_event
        cycle = self.cycle
        assert cycle is not None  # set up by the virtual transport's __init__
        start = time.monotonic()
        limit = None if timeout is None else min(timeout, 1.0)
        while True:
            wake.clear()  # before the attempt: an ack during it makes the wait below return at once
            version = self._version()  # before the attempt too: a publish during it ends the wait
            try:
                cycle.get(self._deliver, timeout=limit)
            except Empty:
                now = time.monotonic()
                if limit is not None and now - start >= limit:
                    raise TimeoutError() from None  # socket.timeout is TimeoutError
                interval = idle
                if limit is not None:
                    interval = min(interval, max(0.0, limit - (now - start)))
                if self._windows_full() or version is None:
                    wake.wait(interval)
                else:
                    if now - self._last_delivery < self.hot_s:
                        self._wait_change(version, interval, self.change_tick, self.hot_tick_max)
                    else:  # idle: a check every idle_tick_max from the start (a few dozen a second)
                        self._wait_change(version, interval, self.idle_tick_max, self.idle_tick_max)
            else:
                self._last_delivery = time.monotonic()
                return None

    def _wait_change(self, version: tuple[int, int], limit: float, tick: float, tick_max: float) -> None:
        """Until the broker's version moves from ``version``, this process acks, or ``limit`` s."""
        wake = self._wake_event
        assert wake is not None
        end = time.monotonic() + limit
        while True:
            left = end - time.monotonic()
            if left <= 0 or wake.wait(min(tick, left)) or self._version() != version:
                return
            tick = min(tick * 2, tick_max)

    def _windows_full(self) -> bool:
        """Every consuming channel with a prefetch window (the task queue's) has it full: polling for
        tasks is pointless until this process acks or rejects one. Channels without a window (Celery's
        remote-control queue, no_ack) do not count: they alone kept the worker polling every 5 ms
        through every task, taking the GIL from the engine thread beside it."""
        limited = [ch for ch in self.channels if ch._consumers and ch.qos.prefetch_count]
        return bool(limited) and not any(ch.qos.can_consume() for ch in limited)

    def establish_connection(self) -> Any:
        Database.get(database_path(self.client))  # fail fast on a bad path
        return super().establish_connection()


def set_wal(conn: sqlite3.Connection, patience: float = 30.0) -> None:
    """Put the database in WAL mode (a persistent property of the file).

    Switching the journal mode needs an exclusive lock and SQLite answers ``database is locked`` at
    once, without its busy timeout, when another process holds the file, as when several workers
    open a fresh file together: retry with jitter, and skip the switch once the file is in WAL.
    """
    deadline = time.monotonic() + patience
    while True:
        try:
            with SQLITE_LOCK:
                if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                    conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02 + random.random() * 0.08)
