"""Waiting for many task results at once (the gateway's stages, the benchmarks).

Polling every pending ``AsyncResult`` every 20 ms cost a group about 10 ms of waiting on average and
one result-store read per pending task per poll. ``ResultWaiter`` reads every pending result in one
batched read (``mget`` of Celery's key-value backends) and sleeps until the backend signals a change:

- Loom's embedded SQLite store: ``PRAGMA data_version`` changes when another connection commits; it
  is a counter read without touching a table, checked every 1 to 4 ms (backing off while quiet);
- Redis: Celery publishes every state change on the result's key as a channel; the waiter subscribes
  to the pending keys and blocks on the subscription;
- any other backend: a read every ``poll`` seconds.

A full read also runs at least every ``max_quiet`` seconds whatever the signal says, so a missed
signal costs latency, never a result.

``ResultHub`` serves many waiters at once from ONE thread: each coroutine awaits its task's result
(``await hub.wait(task_id)``) and the hub's thread runs a ``ResultWaiter`` over the union of the
pending ids. A pending task then costs a dict entry and a future, not a thread (the gateway's jobs
and runs, docs/security.md).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from typing import Any

from celery import states
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from loom.closing import Closing

log = logging.getLogger("loom.results")

MetaMap = dict[str, dict[str, Any]]
# the result store is down (a Redis restart): a reader waits and reads again
STORE_UNREACHABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError)


def stored_metas(app: Any, ids: Iterable[str]) -> MetaMap:
    """Task id -> stored meta (``status``, ``result``) of the ``ids`` the result store has anything
    for, in any state: one batched read (``mget``) where the store has it, else one read per id."""
    ids, b = list(ids), app.backend
    if not ids:
        return {}
    if hasattr(b, "mget") and hasattr(b, "get_key_for_task"):
        values = b.mget([b.get_key_for_task(t) for t in ids])
        return {t: b.decode_result(raw) for t, raw in zip(ids, values, strict=True) if raw is not None}
    metas = {t: b.get_task_meta(t) for t in ids}
    return {t: m for t, m in metas.items() if m.get("status", states.PENDING) != states.PENDING}


class ResultWaiter(Closing):
    def __init__(self, app: Any, poll: float = 0.02, tick: float = 0.001, max_quiet: float = 0.25) -> None:
        self.app = app
        self.backend = app.backend
        self.poll = poll
        self.tick = tick
        self.max_quiet = max_quiet
        self._batched = hasattr(self.backend, "mget") and hasattr(self.backend, "get_key_for_task")
        self._version = getattr(self.backend, "data_version", None)  # embedded SQLite store
        self._pubsub: Any = None
        self._subscribed: set[bytes] = set()
        client: Any = getattr(self.backend, "client", None)
        if self._version is None and self._batched and hasattr(client, "pubsub"):  # Redis
            try:
                self._pubsub = client.pubsub(ignore_subscribe_messages=True)
            except Exception:  # no pub/sub: poll
                self._pubsub = None

    # --- reads ---------------------------------------------------------------------------------------
    def ready(self, ids: Iterable[str]) -> MetaMap:
        """Task id -> meta (``status``, ``result``; an exception for failures) of the ready ones."""
        ids = list(ids)
        if not ids:
            return {}
        if not self._batched:
            out: MetaMap = {}
            for tid in ids:
                res = self.app.AsyncResult(tid)
                if res.ready():
                    out[tid] = {"status": res.state, "result": res.result}
            return out
        return {t: m for t, m in stored_metas(self.app, ids).items() if m["status"] in states.READY_STATES}

    # --- waiting -------------------------------------------------------------------------------------
    def wait(self, ids: Iterable[str], timeout: float, interrupt: threading.Event | None = None) -> MetaMap:
        """The ready ones among ``ids``: as soon as at least one is, or ``{}`` after ``timeout`` s (or as
        soon as ``interrupt`` is set: the caller has new ids to wait for)."""
        ids = list(ids)
        deadline = time.monotonic() + max(0.0, timeout)
        self._subscribe(ids)
        while True:
            # the version is taken BEFORE the read: a commit between the two still wakes the sleep
            version = self._version() if self._version is not None else 0
            found = self.ready(ids)
            if found or not ids:
                self._unsubscribe(found)
                return found
            left = deadline - time.monotonic()
            if left <= 0 or (interrupt is not None and interrupt.is_set()):
                return {}
            self._sleep(min(left, self.max_quiet), version, interrupt)

    def _sleep(self, limit: float, start: int = 0, interrupt: threading.Event | None = None) -> None:
        """Until the backend signals a change (since ``start``, the store's version at the last read),
        ``interrupt`` is set, or ``limit`` seconds have passed."""
        end = time.monotonic() + limit
        if self._version is not None:
            # a check costs a wake-up and one PRAGMA (~50 us); the interval doubles up to 4 ticks while
            # nothing changes, so a long wait costs ~1 % of a core, and a change is seen within 4 ms
            tick = self.tick
            if self._version() != start:
                return
            while time.monotonic() < end:
                time.sleep(tick)
                if self._version() != start or (interrupt is not None and interrupt.is_set()):
                    return
                tick = min(tick * 2, 4 * self.tick)
            return
        if self._pubsub is not None and self._subscribed:
            # with an interrupt, the subscription is read in 20 ms slices so a new id is not kept waiting
            step = limit if interrupt is None else min(limit, 0.02)
            try:
                while True:
                    msg = self._pubsub.get_message(timeout=step)
                    if msg is not None:
                        while msg is not None:  # drain: one read answers them all
                            msg = self._pubsub.get_message(timeout=0.0)
                        return
                    if time.monotonic() >= end or (interrupt is not None and interrupt.is_set()):
                        return
            except Exception:  # a broken subscription: fall back to polling
                self._close_pubsub()
        if interrupt is not None:
            interrupt.wait(min(limit, self.poll))
        else:
            time.sleep(min(limit, self.poll))

    def _subscribe(self, ids: list[str]) -> None:
        """Subscribe to exactly the keys of ``ids``: new ones added, ones no longer waited for dropped
        (a waiter that lives as long as its process must not collect subscriptions)."""
        if self._pubsub is None:
            return
        want = {bytes(self.backend.get_key_for_task(t)) for t in ids}
        new, gone = want - self._subscribed, self._subscribed - want
        try:
            if gone:
                self._pubsub.unsubscribe(*gone)
                self._subscribed -= gone
            if new:
                self._pubsub.subscribe(*new)
                self._subscribed |= new
        except Exception:
            self._close_pubsub()

    def _unsubscribe(self, found: MetaMap) -> None:
        if self._pubsub is None or not found:
            return
        keys = {bytes(self.backend.get_key_for_task(t)) for t in found} & self._subscribed
        if keys:
            try:
                self._pubsub.unsubscribe(*keys)
            except Exception:
                self._close_pubsub()
            self._subscribed -= keys

    def _close_pubsub(self) -> None:
        ps, self._pubsub = self._pubsub, None
        self._subscribed.clear()
        if ps is not None:
            try:
                ps.close()
            except Exception:
                pass

    def close(self) -> None:
        self._close_pubsub()


class ResultHub:
    """Task results for coroutines, read by one thread: ``meta = await hub.wait(task_id)`` (the meta of
    ``ResultWaiter.ready``: ``status`` and ``result``). Waiters on any event loop; a cancelled waiter
    is forgotten. A result store that is unreachable is read again every second (the waiters wait)."""

    def __init__(self, app: Any, poll: float = 0.02, max_quiet: float = 0.25, name: str = "loom-results"):
        self.app = app
        self.poll, self.max_quiet, self.name = poll, max_quiet, name
        self._lock = threading.Lock()
        self._waiting: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[dict[str, Any]]]]] = {}
        self._changed = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def pending(self) -> int:
        with self._lock:
            return len(self._waiting)

    async def wait(self, task_id: str) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()
        entry = (loop, fut)
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the result hub is closed")
            self._waiting.setdefault(task_id, []).append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._changed.set()
        try:
            return await fut
        finally:
            if not fut.done() or fut.cancelled():
                with self._lock:
                    waiters = self._waiting.get(task_id, [])
                    if entry in waiters:
                        waiters.remove(entry)
                    if not waiters:
                        self._waiting.pop(task_id, None)

    def _run(self) -> None:
        with ResultWaiter(self.app, poll=self.poll, max_quiet=self.max_quiet) as waiter:
            while not self._closed.is_set():
                self._changed.clear()  # before the snapshot: an id added after it sets it again
                with self._lock:
                    ids = list(self._waiting)
                if not ids:
                    self._changed.wait(1.0)
                    continue
                try:
                    ready = waiter.wait(ids, timeout=self.max_quiet, interrupt=self._changed)
                except STORE_UNREACHABLE as exc:
                    log.warning("result store unreachable (%s); reading again in 1 s", exc)
                    self._closed.wait(1.0)
                    continue
                except Exception:  # a bug must not leave every waiter of the process hanging silently
                    log.exception("reading task results failed; reading again in 1 s")
                    self._closed.wait(1.0)
                    continue
                for task_id, meta in ready.items():
                    with self._lock:
                        waiters = self._waiting.pop(task_id, [])
                    for loop, fut in waiters:
                        try:
                            loop.call_soon_threadsafe(_resolve, fut, meta)
                        except RuntimeError:  # that loop is closed: nobody waits there any more
                            pass

    def close(self) -> None:
        self._closed.set()
        self._changed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)


def _resolve(fut: asyncio.Future[dict[str, Any]], meta: dict[str, Any]) -> None:
    if not fut.done():
        fut.set_result(meta)
