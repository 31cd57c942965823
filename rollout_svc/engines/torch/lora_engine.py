"""``LoraView``: a ``TorchEngine`` that serves one LoRA adapter of its base engine's model, sharing
that engine's weights, batching scheduler and lock (``lora``: every row its own adapter).

A view is the base engine's state seen through one adapter: the same scheduler (its requests decode
in the base's batches, beside the base's and other adapters' rows, tagged with the adapter), the
base's current model (a policy load of the base is seen at once), and a prefix cache of the
adapter's own on the single-request path (group layouts, ``batching=False``), where the batched
path keys the base's prefix cache with the adapter's tag. The adapter's factors are held by the
base's ``LoraSet`` (an LRU); a view whose adapter was evicted reads it again at its next request.
Loading a policy or an adapter through a view is refused: it serves one adapter of the base."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from loom.contracts.wire import PolicyVersion, SamplingParams
from rollout_svc.engines.base import (
    Completion,
    Layout,
    Listener,
    Progress,
    PromptLogprobs,
    UnsupportedCapability,
)
from rollout_svc.engines.torch.engine import TorchEngine
from rollout_svc.engines.torch.lora import LoraAdapter
from rollout_svc.engines.torch.prefix_cache import PrefixCache


class LoraView(TorchEngine):
    """One adapter of ``base`` (module docstring); made by ``TorchEngine.adapted`` / ``lora_view``."""

    base: TorchEngine
    folder: Path
    own_prefix: PrefixCache

    @classmethod
    def of(cls, base: TorchEngine, folder: Path, version: int, namespace: str | None) -> LoraView:
        view = cls.__new__(cls)
        view.__dict__.update(base.__dict__)  # settings, scheduler, lock, stats: the base's own objects
        view.base, view.folder = base, folder
        view.own_prefix = PrefixCache(base.prefix.capacity)
        view.policy_version, view.policy_namespace = version, namespace
        base.view_refs.add(view)
        view.adapter()  # read now: a broken adapter fails here, not at its first request
        return view

    def adapter(self) -> LoraAdapter:
        """The adapter's factors (read again if the base's LRU let them go). Never called with the
        engine held: a new adapter's hooks wait for the running batch (``lora_adapter``)."""
        return self.base.lora_adapter(self.folder)

    @property  # type: ignore[override]
    def model(self) -> Any:
        return self.base.model

    @model.setter
    def model(self, value: Any) -> None:
        raise UnsupportedCapability(self.name, "lora", "an adapter view serves its base's model")

    @property  # type: ignore[override]
    def prefix(self) -> PrefixCache:
        """The adapter's own prefix cache (the single-request path; the batched one tags keys)."""
        return self.own_prefix

    @prefix.setter
    def prefix(self, value: PrefixCache) -> None:
        self.own_prefix = value

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        await asyncio.to_thread(self.adapter)  # a reload reads files: off the event loop
        return await super().generate(prompt_ids, params, layout)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Progress]:
        await asyncio.to_thread(self.adapter)
        async for progress in super().stream(prompt_ids, params):
            yield progress

    def generate_sync(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        with self.base.lora.rows(self.model, self.adapter()):  # this thread's forwards only
            return super().generate_sync(prompt_ids, params, layout)

    def _submit(
        self, prompt_ids: list[int], params: SamplingParams, listener: Listener | None = None
    ) -> Future[list[Completion]]:
        return self.scheduler.submit(prompt_ids, params, listener, adapter=self.adapter())

    def prompt_logprobs_sync(self, token_ids: list[int], k: int) -> PromptLogprobs:
        with self.base.lora.rows(self.model, self.adapter()):
            return super().prompt_logprobs_sync(token_ids, k)

    def score_attention_sync(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        with self.base.lora.rows(self.model, self.adapter()):
            return super().score_attention_sync(token_ids, steps, delta, zero_from)

    async def lora_view(self, policy: PolicyVersion) -> TorchEngine:
        return await self.base.lora_view(policy)  # adapters apply to the base

    def load_policy_sync(self, policy: PolicyVersion) -> None:
        raise UnsupportedCapability(self.name, "lora", "a LoRA view serves one adapter of its base")

    def adapted_sync(self, adapter: str) -> TorchEngine:
        raise UnsupportedCapability(self.name, "lora", "adapters apply to the base model, not to an adapter")

    def _clear_prefixes(self) -> None:
        self.own_prefix.clear()

    def stop_scheduler(self, timeout: float = 5.0) -> None:
        return None  # the base's scheduler: the base stops it
