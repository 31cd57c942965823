"""``Closing``: the context-manager mixin of everything that owns a ``close()`` (clients, pools,
waiters, session managers): ``with thing:`` closes it at the end."""

from __future__ import annotations

from typing import Self


class Closing:
    """``with x:`` calls ``x.close()`` at the end (``__enter__`` returns ``x``)."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
