"""Reflection reward, REA-RL eq. 3 (docs/algorithms.md §1.5):

R = min(0, D / D_q − 1),  D = reflections / thinking tokens,

reflections counted case-insensitively from a keyword list, a run of keywords each within 59
characters of the previous one counting once; D_q is a fixed value (default 1/225.09, the authors'
code) or the q-quantile of the densities the service has seen (a running estimate).
"""

from __future__ import annotations

import re
import threading
from collections import deque
from typing import Any

from loom.contracts.rewards import ReflectionParams
from reward_svc.context import GroupContext
from reward_svc.trace import approx_tokens, thinking_text


def count_reflections(text: str, keywords: list[str], cluster_chars: int = 59) -> int:
    """Keyword occurrences (whole words, any case); an occurrence starting within ``cluster_chars``
    characters of the previous one's start belongs to the same reflection."""
    words = [re.escape(k) for k in keywords if k.strip()]
    if not words:
        return 0
    pattern = re.compile(r"\b(?:" + "|".join(words) + r")\b", re.IGNORECASE)
    count, prev = 0, None
    for m in pattern.finditer(text):
        if prev is None or m.start() - prev > cluster_chars:
            count += 1
        prev = m.start()
    return count


def reflection_reward(density: float, d_q: float) -> float:
    """REA-RL eq. 3."""
    return min(0.0, density / d_q - 1.0)


class DensityStats:
    """Running densities per key (bounded window), for the D_q quantile. Thread-safe."""

    def __init__(self, window: int = 20_000) -> None:
        self._seen: dict[str, deque[float]] = {}
        self._window = window
        self._lock = threading.Lock()

    def add(self, key: str, values: list[float]) -> None:
        with self._lock:
            self._seen.setdefault(key, deque(maxlen=self._window)).extend(values)

    def quantile(self, key: str, q: float, min_seen: int) -> float | None:
        with self._lock:
            values = sorted(self._seen.get(key, ()))
        if len(values) < min_seen:
            return None
        return values[min(len(values) - 1, int(q * len(values)))]


def reflection(ctx: GroupContext, params: dict[str, Any]) -> list[float]:
    p = ReflectionParams.model_validate(params)
    densities = []
    for v in ctx.views:
        thinking = thinking_text(v.text, ctx.markers)
        n_tokens: float = v.n_tokens
        if thinking != v.text:  # the thinking part's share of the trajectory's tokens, in its unit
            whole = approx_tokens(v.text)
            n_tokens = v.n_tokens * approx_tokens(thinking) / whole if whole else 0.0
        n = count_reflections(thinking, p.keywords, p.cluster_chars)
        densities.append(n / n_tokens if n_tokens else 0.0)
    d_q = p.fixed_value
    if p.d_q == "running" and isinstance(ctx.state, DensityStats):
        ctx.state.add(p.stat_key, densities)
        d_q = ctx.state.quantile(p.stat_key, p.q, p.min_seen) or p.fixed_value
    return [reflection_reward(d, d_q) for d in densities]
