"""Full policy versions a torch engine has loaded before, kept in memory for the next request that
names them: an LRU bounded by the bytes of the models' parameters (``TorchEngine(versions_bytes)``,
``LOOM_ROLLOUT_TORCH_VERSIONS_BYTES``). Swapping a held version in costs no file read and no
allocation; 0 bytes holds none (every load reads its files)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

VersionKey = tuple[int, str | None, str]  # (version, namespace, path)


def model_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class ModelLru:
    """Models by ``VersionKey``, least recently used first out past ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._held: OrderedDict[VersionKey, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._held)

    def take(self, key: VersionKey) -> Any:
        """The model held for ``key`` (it leaves the LRU: it becomes the engine's), else None."""
        with self._lock:
            got = self._held.pop(key, None)
            self.hits += got is not None
            return None if got is None else got[0]

    def put(self, key: VersionKey, model: Any) -> None:
        """Keep ``model`` (a model that does not fit alone is not kept)."""
        size = model_bytes(model)
        with self._lock:
            self._held.pop(key, None)
            if size > self.max_bytes:
                return
            self._held[key] = (model, size)
            while sum(s for _, s in self._held.values()) > self.max_bytes:
                self._held.popitem(last=False)
