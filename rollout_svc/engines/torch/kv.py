"""The running batch's static KV cache (docs/benchmarks/engine.md): per layer one
preallocated (rows, KV heads, width, head dim) buffer of keys and one of values, written in place.

Rows are left-padded as before: every row's last real token sits in the column just before ``end``,
so a decode step writes every row's new keys and values into the same column ``end`` (no
``torch.cat`` of the whole cache per layer per step, as transformers' ``DynamicCache`` does). The
batch occupies rows ``[0, rows)`` and columns ``[start, end)``; ``mask`` (rows, width, bool) marks
each row's real tokens there and is False elsewhere, so what lies outside (another row's stale
values, zeros) is never attended. A row leaving is replaced by the last row (one row copied, not
every row after it; the scheduler keeps each request's rows in sample order by ``Row.sample``);
columns that are padding in every row are dropped by moving ``start`` (a view, no copy).

Two ways to run a decode step through it (``full``):

- eager (CPU, and CUDA without graphs): every layer's update returns views of the used columns
  ``[start, end + 1)`` of the used rows, and attention reads only those;
- static shapes (``full=True``, what a CUDA graph captures, ``graphs.DecodeGraphs``): the write
  column is a device tensor (``col``), every layer returns its whole buffer (the first
  ``k.shape[0]`` rows, all columns), and the mask keeps the unused columns out. The same arithmetic
  as eager up to float rounding; the CPU tests run it uncaptured, token-exact."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from rollout_svc.engines.torch.prefix_cache import dynamic_cache, layers

ROW_STEP = 32  # row capacity past 32 rows grows in steps of 32 (the CUDA graphs' row buckets)
WIDTH_STEP = 64  # column capacity is a multiple of 64


def row_bucket(rows: int) -> int:
    """The rows a buffer (and a captured graph) is sized for: a power of two up to 32, then a
    multiple of 32."""
    if rows <= ROW_STEP:
        return 1 << max(0, rows - 1).bit_length()
    return -(-rows // ROW_STEP) * ROW_STEP


class _Layer(DynamicLayer):
    """One layer of a ``StaticKv``: transformers' attention calls ``update`` with the step's keys and
    values; they are written in place and the layer's keys and values to attend are returned."""

    def __init__(self, kv: StaticKv, index: int) -> None:
        super().__init__()
        self.kv, self.index = kv, index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.write(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.kv.end - self.kv.start

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.end - self.kv.start + query_length, 0


class StaticKv(Cache):
    """Preallocated keys and values of the running batch (see the module docstring)."""

    def __init__(self, like: list[tuple[torch.Tensor, torch.Tensor]], rows: int, width: int) -> None:
        """Buffers for ``rows`` x ``width`` positions shaped like the layers ``like`` (one
        (keys, values) pair per layer: their heads, head dim, dtype and device)."""
        self.capacity, self.width = rows, width
        self.keys = [_buffer(k, rows, width) for k, _ in like]
        self.values = [_buffer(v, rows, width) for _, v in like]
        device = like[0][0].device
        self.mask = torch.zeros(rows, width, dtype=torch.bool, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)  # ``end`` on the device (full mode)
        self.rows = 0
        self.start = self.end = 0
        self.full = False
        self.generation = 0  # bumped when the buffers are reallocated (captured graphs go stale)
        self.moves = 0  # times the used columns were moved to the left edge (``make_room``)
        super().__init__(layers=[_Layer(self, i) for i in range(len(like))])

    @property
    def device(self) -> torch.device:
        return self.mask.device

    # ---------------------------------------------------------------------------------------------
    # the forward's side

    def write(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[i], self.values[i]
        if self.full:  # static shapes: k is (bucket rows, heads, 1, dim), the column a device tensor
            n = k.shape[0]
            keys[:n].index_copy_(2, self.col, k)
            values[:n].index_copy_(2, self.col, v)
            return keys[:n], values[:n]
        q, end = k.shape[2], self.end
        keys[: self.rows, :, end : end + q] = k
        values[: self.rows, :, end : end + q] = v
        return keys[: self.rows, :, self.start : end + q], values[: self.rows, :, self.start : end + q]

    def step_mask(self) -> torch.Tensor:
        """Open column ``end`` to every row; the attention mask of the step (rows, 1, 1, columns):
        the used columns (eager) or all of them (``full``)."""
        self.mask[: self.rows, self.end] = True
        if self.full:
            return self.mask[:, None, None, :]
        return self.mask[: self.rows, None, None, self.start : self.end + 1]

    def advance(self) -> None:
        """The step's column is written: the next step writes the one after."""
        self.end += 1

    # ---------------------------------------------------------------------------------------------
    # the scheduler's side

    def add(self, cache: Any, mask: torch.Tensor, room: int) -> None:
        """Append the rows of a prefilled ``cache`` (a DynamicCache, left-padded, ``mask`` (rows,
        its width) with 1 on real tokens), right-aligned at ``end``; the caller has checked the
        capacity (``fits``) with ``room`` columns kept free on the right."""
        n, width = mask.shape
        self.make_room(self.rows + n, width, room)
        rows, end = self.rows, self.end
        for (k, v), keys, values in zip(layers(cache), self.keys, self.values, strict=True):
            keys[rows : rows + n, :, end - width : end] = k
            values[rows : rows + n, :, end - width : end] = v
        self.mask[rows : rows + n] = False
        self.mask[rows : rows + n, end - width : end] = mask.bool()
        self.rows += n

    def fits(self, rows: int, width: int, room: int) -> bool:
        """Whether ``rows`` rows of ``width`` used columns, with ``room`` free columns on the right,
        fit the buffers as they are (else ``grow``)."""
        return rows <= self.capacity and max(width, self.end - self.start) + room <= self.width

    def make_room(self, rows: int, width: int, room: int) -> None:
        """Make the used columns at least ``width`` wide, with ``room`` free columns after ``end``
        (moving the used columns to the left edge when the free ones are on the wrong side)."""
        used = self.end - self.start
        wide = max(used, width)
        if self.rows == 0:
            self.start, self.end = 0, wide
            return
        if self.end - wide >= 0 and self.end + room <= self.width:
            self.start = self.end - wide  # the columns to the left are masked in every live row
            return
        shift = wide - used  # move the used columns to [shift, wide): room on both sides
        self.moves += 1
        n = self.rows
        for buf in (*self.keys, *self.values):
            buf[:n, :, shift:wide] = buf[:n, :, self.start : self.end].clone()
        self.mask[:n, shift:wide] = self.mask[:n, self.start : self.end].clone()
        self.mask[:n, :shift] = False
        self.mask[:n, wide:] = False
        self.start, self.end = 0, wide

    def keep(self, order: list[int]) -> None:
        """Only rows ``order`` go on, new row i the old row ``order[i]``: only the rows whose place
        changes are copied."""
        moved = [i for i, b in enumerate(order) if b != i]
        if moved:
            dst = torch.tensor(moved, device=self.device)
            src = torch.tensor([order[i] for i in moved], device=self.device)
            cols = slice(self.start, self.end)
            for buf in (*self.keys, *self.values):
                buf[dst, :, cols] = buf[src, :, cols]
            self.mask[dst] = self.mask[src]
        self.rows = len(order)

    def drop_left(self, widest: int) -> None:
        """The rows' longest is ``widest`` tokens: the columns before are padding in every row."""
        self.start = max(self.start, self.end - widest)

    def row(self, b: int, length: int) -> Any:
        """Row ``b``'s last ``length`` columns as a DynamicCache of its own (a copy)."""
        cols = slice(self.end - length, self.end)
        return dynamic_cache(
            [
                (k[b : b + 1, :, cols].clone(), v[b : b + 1, :, cols].clone())
                for k, v in zip(self.keys, self.values, strict=True)
            ]
        )


def _buffer(like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    return torch.zeros(rows, like.shape[1], width, like.shape[3], dtype=like.dtype, device=like.device)


def allocate(old: StaticKv | None, like: Any, rows: int, width: int, room: int) -> StaticKv:
    """A ``StaticKv`` that holds ``rows`` rows of ``width`` columns with ``room`` more: ``old`` when it
    fits, else a larger one (bucketed) holding ``old``'s live rows."""
    if old is not None and old.fits(rows, width, room):
        return old
    used = 0 if old is None else old.end - old.start
    need = max(width, used) + room
    cap_rows = max(row_bucket(rows), old.capacity if old is not None else 0)
    cap_width = -(-need // WIDTH_STEP) * WIDTH_STEP
    if old is not None:
        cap_width = max(cap_width, old.width)
    src = [(k, v) for k, v in zip(old.keys, old.values, strict=True)] if old is not None else layers(like)
    new = StaticKv(src, cap_rows, cap_width)
    if old is not None:
        new.generation, new.moves, new.full = old.generation + 1, old.moves, old.full
        if old.rows:  # at [wide - used, wide): ``add`` extends them left to ``width``
            n, start = old.rows, max(width, used) - used
            for dst, buf in zip((*new.keys, *new.values), (*old.keys, *old.values), strict=True):
                dst[:n, :, start : start + used] = buf[:n, :, old.start : old.end]
            new.mask[:n, start : start + used] = old.mask[:n, old.start : old.end]
            new.rows, new.start, new.end = n, start, start + used
    return new
