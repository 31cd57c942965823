"""Per-key token buckets: ``rate`` requests per second on average, bursts of up to ``burst``."""

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
    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def take(self, key: str, cost: float = 1.0) -> float:
        """0.0 when ``key`` may proceed (and pays ``cost``), else the seconds until it may."""
        now = self.clock()
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                b = self._buckets[key] = _Bucket(tokens=self.burst, at=now)
            b.tokens = min(self.burst, b.tokens + (now - b.at) * self.rate)
            b.at = now
            if b.tokens >= cost:
                b.tokens -= cost
                return 0.0
            return (cost - b.tokens) / self.rate


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds (RFC 9110 10.2.3); never 0 for a refused request."""
    return str(max(1, math.ceil(seconds)))
