"""The one token-id rule every service applies to input: ids lie in [0, vocabulary size)."""

from __future__ import annotations

from collections.abc import Sequence


def outside_vocabulary(ids: Sequence[int], size: int) -> int | None:
    """Index of the first id outside [0, ``size``), or None. ``min``/``max`` run at C speed; the
    index is looked for only when there is one (this runs on every generate call and train step)."""
    if not ids or (min(ids) >= 0 and max(ids) < size):
        return None
    return next(i for i, t in enumerate(ids) if not 0 <= t < size)
