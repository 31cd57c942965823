"""The prefix KV cache and the KV-cache surgery of batching.

Finished sequences leave their KV cache behind (LRU, ``capacity`` entries); a new request takes the
longest cached prefix of its key (taken over if the whole entry matches, else copied and cropped) and
computes only the rest, so streaming rounds and shared prefixes cost their new tokens. A key is the
(token id, group) of every position, so a group layout's positions never match a plain prompt's.

Batched caches are left-padded: row b of a batch holds its tokens in the last columns, zero keys and
values on the left (``row_cache``; ``merge`` and ``drop_left`` are the DynamicCache form of what the
running batch's static cache does in place, ``kv.StaticKv``, and its tests' reference)."""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Key = list[tuple[int, int]]  # (token id, group) of every position


@dataclass
class _Entry:
    key: Key  # every position held in ``cache``
    cache: Any


def _common(a: Key, b: Key) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU store of finished sequences' KV caches, keyed by their positions' (token, group)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_entry = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def _longest(self, key: Key) -> tuple[int | None, int]:
        best_id, best_len = None, 0
        for eid, entry in self._entries.items():
            m = _common(entry.key, key)
            if m > best_len:
                best_id, best_len = eid, m
        return best_id, best_len

    def reusable(self, key: Key) -> int:
        """How many of ``key``'s tokens ``take`` would serve from the cache (nothing is taken)."""
        return max(0, min(self._longest(key)[1], len(key) - 1))

    def take(self, key: Key) -> tuple[Any, int]:
        """A cache holding the longest cached prefix of ``key`` (at most len(key) - 1 tokens), and
        its length."""
        from transformers import DynamicCache

        best_id, best_len = self._longest(key)
        reuse = min(best_len, len(key) - 1)
        if best_id is None or reuse <= 0:
            return DynamicCache(), 0
        entry = self._entries[best_id]
        if reuse == len(entry.key):  # the whole entry is a prefix: extend it in place
            del self._entries[best_id]
            return entry.cache, reuse
        cache = copy.deepcopy(entry.cache)
        cache.crop(reuse - len(entry.key))
        self._entries.move_to_end(best_id)
        return cache, reuse

    def store(self, key: Key, cache: Any) -> None:
        if self.capacity <= 0 or not key:
            return
        self._entries[self._next_entry] = _Entry(key, cache)
        self._next_entry += 1
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def retire(
        self, prompt_key: Key, token_ids: list[int], gen_group: int, cache: Any, row: int, start: int = 0
    ) -> None:
        """Keep a finished row's cache: row ``row`` of ``cache`` from column ``start`` (its left
        padding dropped) holds ``prompt_key`` and every generated token but the last (sampled, never
        fed), which continue ``gen_group``."""
        self.retire_with(prompt_key, token_ids, gen_group, lambda: row_cache(cache, row, start))

    def retire_with(
        self, prompt_key: Key, token_ids: list[int], gen_group: int, row: Callable[[], Any]
    ) -> None:
        """``retire`` with the finished row's cache made by ``row()`` (called only when it is kept:
        the batch's static KV cache copies the row out, ``kv.StaticKv.row``)."""
        if self.capacity <= 0:
            return
        self.store(prompt_key + [(t, gen_group) for t in token_ids[:-1]], row())


def layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (keys, values) tensors of every layer of a DynamicCache, each (batch, heads, seq, dim)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def dynamic_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=kv)


def pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    if width <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = width
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def row_cache(cache: Any, row: int, start: int = 0) -> Any:
    """Row ``row`` of a batched cache from column ``start`` on, as a cache of its own (a copy: a view
    would keep the whole batch's tensors alive as long as the entry)."""
    return dynamic_cache(
        [(k[row : row + 1, :, start:].clone(), v[row : row + 1, :, start:].clone()) for k, v in layers(cache)]
    )


def merge(a: Any, a_width: int, b: Any, b_width: int) -> Any:
    """The rows of ``a`` then those of ``b``, the shorter side left-padded to the longer's width."""
    total = max(a_width, b_width)
    return dynamic_cache(
        [
            (
                torch.cat([pad_left(ak, total - a_width, 2), pad_left(bk, total - b_width, 2)]),
                torch.cat([pad_left(av, total - a_width, 2), pad_left(bv, total - b_width, 2)]),
            )
            for (ak, av), (bk, bv) in zip(layers(a), layers(b), strict=True)
        ]
    )


def drop_left(cache: Any, start: int) -> Any:
    """The cache without its first ``start`` columns (padding in every row)."""
    return dynamic_cache([(k[:, :, start:], v[:, :, start:]) for k, v in layers(cache)])
