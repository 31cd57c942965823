"""LoRA versions of the engine's base decoded in one batch: every row its own adapter, the base's
weights shared (the multi-LoRA serving of S-LoRA / punica, https://arxiv.org/abs/2311.03285, and
vLLM's ``--enable-lora --max-loras``; docs/interop-engine.md "Multi-LoRA").

- ``LoraAdapter``: one peft LoRA adapter's factors, read from its folder (``adapter_config.json``,
  ``adapter_model.safetensors``), ``A`` [r, in] and ``B`` [out, r] per target projection and its
  scale (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA: peft's ``LoraLayer.update_layer``).
- ``LoraSet``: the adapters an engine holds, an LRU bounded by a count and by bytes, and the forward
  hooks on the base's target ``nn.Linear`` layers. A forward run inside ``rows(model, adapters)``
  (one adapter, or None for the base, per batch row) adds to each target layer's output, row by row,
  ``scale * (x A^T) B^T`` of that row's adapter: the rows are grouped by adapter inside the step
  (one pair of matmuls per adapter present), so every row's logits are those of the base with its
  own adapter (peft's unmerged forward, ``result + lora_B(lora_A(x)) * scaling``), and base rows get
  the base's. An adapter evicted from the LRU while rows still use it stays alive with them (they
  hold it); its next request reads it again.
- The prefix cache never shares keys and values across adapters: on the batched path an adapter's
  requests key their positions with the adapter's own group tag (``tag``, negative, one per load;
  layouts number groups from 0), so no cached prefix of the base or of another adapter ever matches
  them; on the single-request path a view has a prefix cache of its own (``engine.LoraView``).

A thread's forwards read the plan that thread set (``rows``): the scheduler thread's batches and a
caller's single-request pass (both under the engine's lock) never see each other's. Hooks are added
while the caller holds the engine (``TorchEngine.lora_adapter``), never during a forward."""

from __future__ import annotations

import itertools
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from loom.store.checks import LORA_TENSOR, PREFIX, CheckpointRefused

_uids = itertools.count(1)


@dataclass(eq=False)
class LoraAdapter:
    """One adapter's factors on the engine's device and dtype, by module path of the base model."""

    key: str  # its folder: the LRU's key
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A [r, in], B [out, r])
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def tag(self) -> int:
        """The group its requests' prefix-cache keys carry (never one a layout or the base uses)."""
        return -self.uid

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def read_adapter(folder: Path, model: Any, device: Any, dtype: torch.dtype) -> LoraAdapter:
    """The factors of the peft LoRA adapter in ``folder`` for ``model``'s projections (its files
    already checked against the base: ``loom.store.checks.check_lora``). What peft can express but
    these hooks do not compute (DoRA, trained biases, fan-in-fan-out Conv1D layers, per-module ranks)
    is refused (``CheckpointRefused``) rather than served wrong."""
    from safetensors.torch import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    for flag, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(flag) is bad:
            raise CheckpointRefused(f"adapter_config.json: {flag} is not served by the torch engine")
    if cfg.get("bias", "none") != "none":
        raise CheckpointRefused("adapter_config.json: bias must be 'none'")
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = LORA_TENSOR.fullmatch(name.removeprefix(PREFIX))
        if m is None:
            raise CheckpointRefused(f"tensor {name!r} is not a LoRA factor")
        pairs.setdefault(m["module"], {})[m["ab"]] = t
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, ab in pairs.items():
        layer = model.get_submodule(module)
        if not isinstance(layer, torch.nn.Linear) or set(ab) != {"A", "B"}:
            raise CheckpointRefused(f"{module}: a LoRA pair of a linear layer is needed")
        factors[module] = (ab["A"].to(device, dtype), ab["B"].to(device, dtype))
    if not factors:
        raise CheckpointRefused("the adapter holds no LoRA factor")
    return LoraAdapter(str(folder), scale, factors)


Groups = list[tuple[LoraAdapter, torch.Tensor | None]]  # each adapter and its rows (None: every row)
STACK_BYTES = 64 << 20  # the most a plan's stacked factors may take (else: grouped by adapter)


class Plan:
    """The adapters of one batch's rows: ``groups`` (each adapter and its rows, None: every row) and,
    made once per batch composition and per layer, the rows' factors stacked (punica's gathered
    form, https://arxiv.org/abs/2310.18547: ``A`` [rows, r, in], ``B * scale`` [rows, out, r], zeros
    for base rows and for ranks below the widest), so a layer costs one pair of batched matmuls
    whatever the number of adapters. Past ``STACK_BYTES`` a layer is computed adapter by adapter."""

    def __init__(self, groups: Groups, rows: int) -> None:
        self.groups, self.rows = groups, rows
        self._stacked: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}

    @property
    def one(self) -> LoraAdapter | None:
        """The adapter of every row, when there is one."""
        return self.groups[0][0] if len(self.groups) == 1 and self.groups[0][1] is None else None

    def stacked(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        if name not in self._stacked:
            self._stacked[name] = self._stack(name)
        return self._stacked[name]

    def _stack(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        mine = [(a.factors[name], a.scale, idx) for a, idx in self.groups if name in a.factors]
        if not mine:
            return None
        (a0, b0), _, _ = mine[0]
        rank = max(ab[0].shape[0] for ab, _, _ in mine)
        if self.rows * rank * (a0.shape[1] + b0.shape[0]) * a0.element_size() > STACK_BYTES:
            return None
        a_rows = a0.new_zeros(self.rows, rank, a0.shape[1])
        b_rows = b0.new_zeros(self.rows, b0.shape[0], rank)
        for (a, b), scale, idx in mine:
            a_rows[idx, : a.shape[0]] = a
            b_rows[idx, :, : a.shape[0]] = b * scale
        return a_rows, b_rows


def plan_of(adapters: Sequence[LoraAdapter | None] | LoraAdapter | None, device: Any) -> Plan | None:
    """Rows grouped by adapter: one adapter for the whole batch, or one (or None) per row."""
    if adapters is None or isinstance(adapters, LoraAdapter):
        return None if adapters is None else Plan([(adapters, None)], 0)
    rows: dict[int, tuple[LoraAdapter, list[int]]] = {}
    for b, a in enumerate(adapters):
        if a is not None:
            rows.setdefault(id(a), (a, []))[1].append(b)
    if not rows:
        return None
    if len(rows) == 1 and len(next(iter(rows.values()))[1]) == len(adapters):
        return Plan([(next(iter(rows.values()))[0], None)], len(adapters))
    return Plan([(a, torch.tensor(idx, device=device)) for a, idx in rows.values()], len(adapters))


class LoraSet:
    """The adapters an engine holds (LRU: at most ``max_adapters`` and ``max_bytes`` of factors; the
    newest always stays) and the hooks that apply them per row (module docstring)."""

    def __init__(self, max_adapters: int = 8, max_bytes: int = 256 << 20) -> None:
        self.max_adapters, self.max_bytes = max(1, max_adapters), max_bytes
        self._held: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._lock = threading.Lock()  # the LRU: callers' threads and the scheduler's
        self._local = threading.local()  # each thread's plan (module docstring)
        self._hooked: dict[str, Any] = {}  # module path -> hook handle, on ``_model``
        self._model: Any = None
        self.loads = 0  # adapters read from their folders (statistics and tests)
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        return str(key) in self._held

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in list(self._held.values()))

    def get(self, folder: Path, model: Any, device: Any, dtype: torch.dtype) -> LoraAdapter:
        """The adapter in ``folder``: the one held (now the most recent), else read and held."""
        key = str(folder)
        with self._lock:
            adapter = self._held.get(key)
            if adapter is not None:
                self._held.move_to_end(key)
                return adapter
        adapter = read_adapter(folder, model, device, dtype)
        with self._lock:
            self.loads += 1
            self._held[key] = adapter
            while len(self._held) > 1 and (
                len(self._held) > self.max_adapters or self.nbytes > self.max_bytes
            ):
                self._held.popitem(last=False)
                self.evictions += 1
        return adapter

    def forget(self, folder: Path | str) -> None:
        with self._lock:
            self._held.pop(str(folder), None)

    def hooked(self, model: Any, adapter: LoraAdapter) -> bool:
        return model is self._model and adapter.factors.keys() <= self._hooked.keys()

    def hook(self, model: Any, adapter: LoraAdapter) -> None:
        """Hooks on the adapter's modules of ``model`` (a new model: moved there). The caller holds
        the engine (no forward runs meanwhile)."""
        if model is not self._model:
            for handle in self._hooked.values():
                handle.remove()
            self._hooked, self._model = {}, model
        for name in adapter.factors.keys() - self._hooked.keys():
            self._hooked[name] = model.get_submodule(name).register_forward_hook(self._delta(name))

    @contextmanager
    def rows(self, model: Any, adapters: Sequence[LoraAdapter | None] | LoraAdapter | None) -> Iterator[None]:
        """This thread's forwards of ``model`` inside apply ``adapters`` (one per batch row, or one
        for all); an adapter whose hooks are not on ``model`` is refused, never served as the base.
        A batch's plan is kept while its rows stay the same (the decode steps between admissions)."""
        plan = self._plan_for(adapters, next(model.parameters()).device)
        if plan is None:
            yield
            return
        for adapter, _ in plan.groups:
            if not self.hooked(model, adapter):
                raise RuntimeError("a LoRA adapter's hooks are not on the engine's model")
        self._local.plan = plan
        try:
            yield
        finally:
            self._local.plan = None

    def _plan_for(
        self, adapters: Sequence[LoraAdapter | None] | LoraAdapter | None, device: Any
    ) -> Plan | None:
        if adapters is None or isinstance(adapters, LoraAdapter):
            return plan_of(adapters, device)
        key = tuple(0 if a is None else a.uid for a in adapters)
        last = getattr(self._local, "last", None)
        if last is not None and last[0] == key:
            plan: Plan | None = last[1]
            return plan
        plan = plan_of(adapters, device)
        self._local.last = (key, plan)
        return plan

    def _delta(self, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
            plan: Plan | None = getattr(self._local, "plan", None)
            if plan is None:
                return None
            x = args[0]
            one = plan.one
            if one is not None:  # peft: result + lora_B(lora_A(x)) * scaling
                ab = one.factors.get(name)
                return None if ab is None else out + (x @ ab[0].T) @ ab[1].T * one.scale
            stacked = plan.stacked(name)
            if stacked is not None:  # rows' own factors, one pair of batched matmuls
                a_rows, b_rows = stacked
                n = plan.rows
                delta = (x[:n] @ a_rows.transpose(1, 2)) @ b_rows.transpose(1, 2)
                if n == out.shape[0]:
                    return out + delta
                return torch.cat([out[:n] + delta, out[n:]])  # static shapes: padding rows after
            for adapter, idx in plan.groups:
                ab = adapter.factors.get(name)
                if ab is not None:
                    assert idx is not None
                    out = out.index_add(0, idx, (x[idx] @ ab[0].T) @ ab[1].T * adapter.scale)
            return out

        return hook
