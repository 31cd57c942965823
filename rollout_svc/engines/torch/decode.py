"""One decode step of the running batch over its static KV cache (``kv.StaticKv``): every row fed its
sampled token, the next logits of every row.

- ``eager`` (the default, CPU and CUDA): transformers' forward over the used rows and columns; for
  the Llama-shaped families the same computation through the model's leaf modules
  (``lean.LeanStep``: the model forward's Python machinery is most of a small body's step on CPU).
- ``static``: the same forward with static shapes (rows padded to ``kv.row_bucket``, every column,
  the write column a device tensor): what a CUDA graph can hold. Run uncaptured, it is the CPU
  tests' check of the static-shape arithmetic.
- ``graphs`` (CUDA only, ``TorchEngine(cuda_graphs=True)``): the static step captured once per row
  bucket in a ``torch.cuda.CUDAGraph`` (after a warm-up on a side stream, the capture rules of
  https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs) and replayed: one launch per step
  instead of one per kernel. A graph holds the model's weights and the cache's buffers by address,
  so a policy load (``forget``) or a reallocated cache (``StaticKv.generation``) recaptures. A
  capture that fails (an operation of the model that cannot be captured) is logged once and the
  static step runs uncaptured from then on (``graph_error``).

The step passes its own 4D mask, which transformers uses as it is for every layer: a sliding-window
model's window (``loom.architectures.Attention``) is therefore added here, the keys of columns at or
before ``end - window`` closed (rows are contiguous and right-aligned at ``end``, so a column's
distance to ``end`` is its distance to the query); a model with windows on some layers only gets
``{"full_attention": mask, "sliding_attention": windowed}``, transformers' per-layer-type masks."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from loom.architectures import FULL, SLIDING, Attention
from rollout_svc.engines.torch.kv import StaticKv, row_bucket
from rollout_svc.engines.torch.lean import LeanStep, lean_step

log = logging.getLogger("loom.rollout.torch")

Mode = Literal["eager", "static", "graphs"]


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor  # the captured step's output (static)


class DecodeStep:
    """The decode forward of one scheduler, in ``mode`` (see the module docstring)."""

    def __init__(self, mode: Mode = "eager") -> None:
        self.mode: Mode = mode
        self.attention: Attention | None = None  # the engine's model's (windows), set by the engine
        self.graph_error: str | None = None
        self.captures = 0  # graphs captured (statistics and tests)
        self.replays = 0  # steps run by a graph replay
        self._graphs: dict[int, _Graph] = {}
        self._key: tuple[int, int] | None = None  # (id(model), kv.generation) the graphs belong to
        self._ids: torch.Tensor | None = None  # static inputs, (kv.capacity, 1) each
        self._pos: torch.Tensor | None = None
        self._pool: Any = None
        self.lean = True  # eager steps through ``lean.LeanStep`` where the model allows it
        self.lean_steps = 0  # eager steps it ran (statistics and tests)
        self._lean: tuple[Any, LeanStep | None] | None = None  # (model, its lean step or None)

    def forget(self) -> None:
        """Drop the captured graphs (a policy load: they hold the old weights' addresses; a reallocated
        cache: they hold its buffers'). Their memory pool goes with them: the next capture takes a new
        one (capturing into a freed pool's handle trips the caching allocator's assert)."""
        self._graphs.clear()
        self._key = None
        self._pool = None

    def __call__(self, model: Any, kv: StaticKv, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """Feed row b ``tokens[b]`` at position ``positions[b]``; the rows' next logits (float32)."""
        try:
            if self.mode == "eager":
                return self._eager(model, kv, tokens, positions)
            return self._static(model, kv, tokens, positions)
        finally:
            kv.advance()

    def _eager(self, model: Any, kv: StaticKv, tokens: list[int], positions: list[int]) -> torch.Tensor:
        kv.full = False
        device = kv.device
        x = torch.tensor(tokens, device=device)[:, None]
        pos = torch.tensor(positions, device=device)[:, None]
        step = kv.step_mask()
        # no row is padded: no mask (transformers' generate skips it too)
        mask = None if min(positions) == kv.end - kv.start else self._mask(model, step, kv.end - kv.start)
        lean = self._lean_of(model) if self.lean else None
        if lean is not None:
            self.lean_steps += 1
            return lean(x, pos, kv, mask)
        out = model(x, attention_mask=mask, position_ids=pos, past_key_values=kv, use_cache=True)
        return out.logits[:, -1, :].float()

    def _lean_of(self, model: Any) -> LeanStep | None:
        """The model's lean step, looked up once per model (a policy load brings a new one)."""
        if self._lean is None or self._lean[0] is not model:
            self._lean = (model, lean_step(model, self.attention))
        return self._lean[1]

    def _static(self, model: Any, kv: StaticKv, tokens: list[int], positions: list[int]) -> torch.Tensor:
        rows = len(tokens)
        bucket = min(row_bucket(rows), kv.capacity)
        key = (id(model), kv.generation)
        if key != self._key or self._ids is None or self._pos is None:
            self.forget()
            self._key = key
            self._ids = torch.zeros(kv.capacity, 1, dtype=torch.long, device=kv.device)
            self._pos = torch.zeros(kv.capacity, 1, dtype=torch.long, device=kv.device)
        ids, pos = self._ids, self._pos
        ids[:rows, 0] = torch.tensor(tokens, device=kv.device)
        pos[:rows, 0] = torch.tensor(positions, device=kv.device)
        ids[rows:bucket] = 0
        pos[rows:bucket] = 0
        kv.full = True
        kv.step_mask()
        kv.mask[rows:bucket] = True  # padding rows attend somewhere (no all-masked softmax)
        kv.col.fill_(kv.end)
        try:
            if self.mode == "graphs" and self.graph_error is None and kv.device.type == "cuda":
                graph = self._graphs.get(bucket) or self._capture(model, kv, bucket)
                if graph is not None:
                    graph.graph.replay()
                    self.replays += 1
                    return graph.logits[:rows].clone()
            return self._forward_static(model, kv, ids, pos, bucket)[:rows]
        finally:
            kv.full = False

    def _capture(self, model: Any, kv: StaticKv, bucket: int) -> _Graph | None:
        assert self._ids is not None and self._pos is not None
        ids, pos = self._ids, self._pos
        try:
            side = torch.cuda.Stream(device=kv.device)
            side.wait_stream(torch.cuda.current_stream(kv.device))
            with torch.cuda.stream(side):  # warm-up: writes this step's column, as the replay will
                for _ in range(2):
                    self._forward_static(model, kv, ids, pos, bucket)
            torch.cuda.current_stream(kv.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward_static(model, kv, ids, pos, bucket)
        except Exception as e:  # the model holds an operation a graph cannot capture
            self.graph_error = _chain(e)
            log.warning(
                "CUDA graph capture failed, decoding without graphs: %s", self.graph_error, exc_info=True
            )
            return None
        self.captures += 1
        self._graphs[bucket] = _Graph(graph, logits)
        return self._graphs[bucket]

    def _mask(self, model: Any, mask: torch.Tensor, query: int | torch.Tensor) -> Any:
        """The step's mask (rows, 1, 1, columns), the query in column ``query``, with the model's
        sliding window added (module docstring): the mask itself, or one per layer type. Eager
        attention (soft-capped models) adds its mask to the scores: there it is made additive."""
        att = self.attention
        out: dict[str, torch.Tensor] = {FULL: mask}
        if att is not None and att.windowed:
            assert att.window is not None
            cols = torch.arange(mask.shape[-1], device=mask.device)
            out[SLIDING] = mask & (cols > query - att.window)  # q - k < window, transformers' rule
            if att.uniform_window:
                out = {FULL: out[SLIDING]}
        if getattr(model.config, "_attn_implementation", None) == "eager":
            dtype = next(model.parameters()).dtype
            zero = torch.zeros((), dtype=dtype, device=mask.device)
            low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=mask.device)
            out = {k: torch.where(m, zero, low) for k, m in out.items()}
        return out[FULL] if len(out) == 1 else out

    def _forward_static(
        self, model: Any, kv: StaticKv, ids: torch.Tensor, pos: torch.Tensor, bucket: int
    ) -> torch.Tensor:
        mask = self._mask(model, kv.mask[:bucket, None, None, :], kv.col)  # the query: column ``col``
        out = model(
            ids[:bucket], attention_mask=mask, position_ids=pos[:bucket], past_key_values=kv, use_cache=True
        )
        return out.logits[:, -1, :].float()


def _chain(e: BaseException) -> str:
    """``e`` and the exceptions it was raised while handling, the first cause last, for ``graph_error``
    (an error raised while a failed capture unwinds would otherwise hide the one that failed it)."""
    seen: list[str] = []
    cur: BaseException | None = e
    while cur is not None and len(seen) < 5:
        seen.append(repr(cur))
        cur = cur.__cause__ or cur.__context__
    return " <- while handling ".join(seen)
