"""Token buckets by key (an API key's name, a client address): ``rate`` per second on average, bursts
of up to ``burst``. Buckets that have refilled are dropped once there are more than ``max_keys``, so
a flood of distinct keys (addresses) cannot grow the table without bound."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    at: float


class TokenBuckets:
    def __init__(
        self,
        rate: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        max_keys: int = 10_000,
    ) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.max_keys = max_keys
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def _refilled(self, key: str, now: float) -> _Bucket:
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.max_keys:
                self._prune(now)
            b = self._buckets[key] = _Bucket(tokens=self.burst, at=now)
        b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
        b.at = now
        return b

    def _prune(self, now: float) -> None:
        full = [k for k, b in self._buckets.items() if b.tokens + (now - b.at) * self.rate >= self.burst]
        for k in full:
            del self._buckets[k]

    def take(self, key: str, cost: float = 1.0) -> float:
        """0.0 when ``key`` may proceed (and pays ``cost``), else the seconds until it may."""
        with self._lock:
            b = self._refilled(key, self.clock())
            if b.tokens >= cost:
                b.tokens -= cost
                return 0.0
            return (cost - b.tokens) / self.rate

    def wait(self, key: str, cost: float = 1.0) -> float:
        """The seconds until ``key`` could pay ``cost`` (0.0: now), paying nothing."""
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                return 0.0
            b = self._refilled(key, self.clock())
            return 0.0 if b.tokens >= cost else (cost - b.tokens) / self.rate


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110 10.2.3); never 0 for a refused request."""
    return str(max(1, math.ceil(seconds)))
