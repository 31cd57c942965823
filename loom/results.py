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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from celery import states
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

MetaMap = dict[str, dict[str, Any]]
# the result store is down (a Redis restart): a reader waits and reads again
STORE_UNREACHABLE: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeoutError)


class ResultWaiter:
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
        b = self.backend
        values = b.mget([b.get_key_for_task(t) for t in ids])
        out = {}
        for tid, raw in zip(ids, values, strict=True):
            if raw is None:
                continue
            meta = b.decode_result(raw)
            if meta["status"] in states.READY_STATES:
                out[tid] = meta
        return out

    # --- waiting -------------------------------------------------------------------------------------
    def wait(self, ids: Iterable[str], timeout: float) -> MetaMap:
        """The ready ones among ``ids``: as soon as at least one is, or ``{}`` after ``timeout`` s."""
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
            if left <= 0:
                return {}
            self._sleep(min(left, self.max_quiet), version)

    def _sleep(self, limit: float, start: int = 0) -> None:
        """Until the backend signals a change (since ``start``, the store's version at the last read) or
        ``limit`` seconds have passed."""
        end = time.monotonic() + limit
        if self._version is not None:
            # a check costs a wake-up and one PRAGMA (~50 us); the interval doubles up to 4 ticks while
            # nothing changes, so a long wait costs ~1 % of a core, and a change is seen within 4 ms
            tick = self.tick
            if self._version() != start:
                return
            while time.monotonic() < end:
                time.sleep(tick)
                if self._version() != start:
                    return
                tick = min(tick * 2, 4 * self.tick)
            return
        if self._pubsub is not None and self._subscribed:
            try:
                msg = self._pubsub.get_message(timeout=limit)
                while msg is not None:  # drain: one read answers them all
                    msg = self._pubsub.get_message(timeout=0.0)
                return
            except Exception:  # a broken subscription: fall back to polling
                self._close_pubsub()
        time.sleep(min(limit, self.poll))

    def _subscribe(self, ids: list[str]) -> None:
        if self._pubsub is None:
            return
        keys = {bytes(self.backend.get_key_for_task(t)) for t in ids} - self._subscribed
        if keys:
            try:
                self._pubsub.subscribe(*keys)
                self._subscribed |= keys
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

    def __enter__(self) -> ResultWaiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
