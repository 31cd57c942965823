"""``TorchEngine``: the ``engines.base.Engine`` facade over the torch package's parts.

- Prefix KV cache (``prefix_cache``): a new request reuses the longest cached prefix and computes
  only the rest; ``stats.prefill_tokens`` counts the prompt tokens actually computed.
- Batching (``batching=True``, the default): concurrent requests without a group layout are decoded
  together by one scheduler thread (``scheduler``), their keys and values in one preallocated static
  KV cache written in place (``kv``); with ``cuda_graphs`` (CUDA only, off by default) the decode
  step is captured in CUDA graphs (``decode``). ``stats.extra``: ``decode_steps``,
  ``batched_steps`` (forwards with more than one row), ``peak_batch_rows`` / ``peak_batch_requests``
  (the most rows / requests in one forward). ``batching=False`` serialises every call (one request at
  a time); requests with a layout always take that single-request path (``alone``), and FCI scoring,
  policy loads and cache resets wait for the running batch to end.
- Group layout (StreamingThinker): position ids numbered per group, block visibility mask
  (``base.Layout``); the same ``model.block_mask`` builds the teacher-forced reference pass.
- Limits: a prompt with a token id outside the vocabulary, or one that fills the model's context
  (``max_position_embeddings``), is refused with ``InvalidPrompt``; ``max_tokens`` is capped at the
  room the context leaves (finish_reason "length" there), where vLLM would refuse the request.
- Sampling (``sampling``): temperature / top-k / top-p with a seeded generator, and vLLM's logits
  processors in vLLM's order; the reported log-prob of a sampled token is the raw model log-prob
  (``logprobs_mode="raw"``, vLLM's default) or the log-prob under the processed (tempered,
  truncated) distribution (``"processed"``).
- LoRA versions (``lora``, ``LoraView`` below): ``adapted`` and ``lora_view`` give a view of this
  engine serving one adapter; the views' requests decode in this engine's batches, every row with
  its own adapter over the shared base weights; the adapters' factors are held in an LRU
  (``max_loras`` adapters, ``lora_bytes``). Full versions loaded before are kept in an LRU bounded by
  memory (``versions_bytes``): loading one again swaps it in without reading its files.
- ``stream`` gives every token as it is sampled (the OpenAI routes' ``stream=true``);
  ``prompt_logprobs`` scores a prompt in one forward pass (vLLM's ``prompt_logprobs``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import weakref
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, cast

import torch

from loom.architectures import UnsupportedModel, resolve_dtype
from loom.contracts.wire import MAX_ATTENTION_STEPS, PolicyVersion, SamplingParams
from loom.layout import group_positions
from loom.runtime import MODEL_LOADS
from loom.store.checks import Bounds, CheckpointRefused, check_checkpoint, check_lora_base
from loom.store.publish import PublishLimits
from rollout_svc.engines.base import (
    Capability,
    Completion,
    Engine,
    InvalidPrompt,
    Layout,
    Listener,
    PolicyLoadError,
    Progress,
    PromptLogprobs,
    UnsupportedCapability,
    check_prompt,
    check_sampling,
    check_scored,
)
from rollout_svc.engines.torch.alone import generate_alone
from rollout_svc.engines.torch.lora import LoraAdapter, LoraSet
from rollout_svc.engines.torch.model import (
    Dtype,
    block_mask,
    check_model,
    eos_ids,
    load_adapter,
    load_model,
    load_tokenizer,
    prompt_logprobs,
)
from rollout_svc.engines.torch.prefix_cache import Key, PrefixCache, layers
from rollout_svc.engines.torch.sampling import LogprobsMode, accept, sample
from rollout_svc.engines.torch.scheduler import KvBudget, Scheduler, default_kv_budget, kv_bytes_per_token
from rollout_svc.engines.torch.versions import ModelLru

log = logging.getLogger("loom.rollout.torch")


class TorchEngine(Engine):
    """transformers in-process (CPU or GPU), Loom's reference implementation."""

    name = "torch"
    batches_loras = True
    capabilities = frozenset(
        {"group_positions", "prefix_cache", "attention_scores", "lora", "stop_sequences"}
    )

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        cache_entries: int = 32,
        logprobs_mode: LogprobsMode = "raw",
        model: Any = None,
        tokenizer: Any = None,
        batching: bool = True,
        max_batch_rows: int | None = None,
        dtype: Dtype | Literal["auto"] = "float32",
        kv_budget_bytes: int | None = None,
        cuda_graphs: bool | None = None,
        max_loras: int = 8,
        lora_bytes: int = 256 << 20,
        versions_bytes: int = 0,
    ) -> None:
        super().__init__()
        self.model_path = Path(model_path)
        if model is not None:  # a model handed in decides the device and dtype (inputs live beside it)
            self.model = model
            param = next(model.parameters())
            self.device, self.dtype = str(param.device), cast(Dtype, str(param.dtype).removeprefix("torch."))
        else:  # "auto": the checkpoint's own dtype on CUDA, float32 on CPU (loom.architectures)
            from transformers import AutoConfig

            resolved = resolve_dtype(dtype, AutoConfig.from_pretrained(str(self.model_path)), device)
            self.device, self.dtype = device, cast(Dtype, resolved)
            self.model = load_model(self.model_path, device, self.dtype)
        # exact or refused (loom/architectures.py): the decode step reads the windows per layer
        self.attention = check_model(self.model)
        if self.attention.windowed:
            self.capabilities = type(self).capabilities - {"group_positions"}
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path)
        self.prefix = PrefixCache(cache_entries)
        self.logprobs_kind = logprobs_mode
        # policy loads one at a time: from_pretrained is not thread-safe (transformers' meta-device
        # initialisation patches torch process-wide; two concurrent loads left one model on "meta")
        self._load_lock = threading.Lock()
        self._loaded: tuple[int, str] | None = None  # (version, path) of the last policy loaded
        self.batching = batching
        budget = kv_budget_bytes if kv_budget_bytes is not None else default_kv_budget(self.device)
        if cuda_graphs is None:  # LOOM_ROLLOUT_TORCH_CUDA_GRAPHS (rollout_svc/config.py)
            from rollout_svc.config import get_rollout_settings

            cuda_graphs = get_rollout_settings().torch_cuda_graphs
        self.cuda_graphs = bool(cuda_graphs) and self.device.startswith("cuda")  # never on CPU
        self.scheduler = Scheduler(
            self,
            KvBudget(kv_bytes_per_token(self.model.config, self.dtype), budget),
            max_batch_rows,
            "graphs" if self.cuda_graphs else "eager",
        )
        self.scheduler.decode.attention = self.attention
        self.eos_ids: set[int] = eos_ids(self.model, self.tokenizer)
        self.lora = LoraSet(max_loras, lora_bytes)
        self.versions = ModelLru(versions_bytes)  # full versions loaded before (``load_policy_sync``)
        self._views: OrderedDict[tuple[int, str | None, str], TorchEngine] = OrderedDict()
        self.view_refs: weakref.WeakSet[TorchEngine] = weakref.WeakSet()  # every view's prefix cache

    @property
    def cache_entries(self) -> int:
        return self.prefix.capacity

    @property
    def max_batch_rows(self) -> int | None:
        """The hard cap on rows in flight, if one was set (else the KV budget alone decides)."""
        return self.scheduler.max_rows

    # ---------------------------------------------------------------------------------------------
    # interface

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        if self.batching and layout is None:
            params = self._fit(prompt_ids, params, layout)
            return await asyncio.wrap_future(self._submit(prompt_ids, params))
        return await asyncio.to_thread(self.generate_sync, prompt_ids, params, layout)

    def generate_sync(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        params = self._fit(prompt_ids, params, layout)
        if self.batching and layout is None:
            return self._submit(prompt_ids, params).result()
        with self._exclusive(), torch.no_grad():
            return generate_alone(self, prompt_ids, params, layout)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Progress]:
        """Every accepted token as it is sampled (the batching scheduler tells the request's listener,
        on the scheduler thread; the events cross to this loop in order)."""
        if not self.batching:
            async for progress in super().stream(prompt_ids, params):
                yield progress
            return
        params = self._fit(prompt_ids, params, None)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Progress] = asyncio.Queue()

        def listener(progress: Progress) -> None:
            loop.call_soon_threadsafe(events.put_nowait, progress)

        fut = self._submit(prompt_ids, params, listener)
        done: asyncio.Future[list[Completion]] = asyncio.wrap_future(fut)
        ended = 0
        try:
            while ended < params.n:
                if done.done() and events.empty():
                    done.result()  # the request failed: its error; else every event has been read
                    return
                get: asyncio.Future[Progress] = asyncio.ensure_future(events.get())
                await asyncio.wait((get, done), return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                progress = get.result()
                ended += progress.ended
                yield progress
        finally:
            fut.cancel()  # a client that went away: drop the request if it has not started

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobs:
        return await asyncio.to_thread(self.prompt_logprobs_sync, token_ids, k)

    def prompt_logprobs_sync(self, token_ids: list[int], k: int) -> PromptLogprobs:
        """One forward pass over ``token_ids`` (no prefix cache), serialised with generation."""
        check_scored(list(token_ids), 0, self.vocab_size, self.max_model_len, 0)
        with self._exclusive():
            return prompt_logprobs(self.model, token_ids, k, self.device)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_input_embeddings().num_embeddings)

    @property
    def max_model_len(self) -> int | None:
        n = getattr(self.model.config, "max_position_embeddings", None)
        return int(n) if n else None

    async def score_attention(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        return await asyncio.to_thread(self.score_attention_sync, token_ids, steps, delta, zero_from)

    def score_attention_sync(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        """FCI scores (docs/algorithms.md §2.3; AttnRL eq. 5-6) by loom.fci's streaming pass, serialised
        with generation."""
        from loom.fci import fci_scores

        check_scored(list(token_ids), len(steps), self.vocab_size, self.max_model_len, MAX_ATTENTION_STEPS)
        with self._exclusive():
            return fci_scores(self.model, token_ids, steps, delta=delta, zero_from=zero_from)

    async def load_policy(self, policy: PolicyVersion) -> None:
        await asyncio.to_thread(self.load_policy_sync, policy)

    def _bounds(self) -> Bounds:
        """What a version may declare beside the engine's base (the store's publishing bounds)."""
        limits = PublishLimits()
        return Bounds.of(self.model_path, limits.size_factor, limits.max_params)

    def load_policy_sync(self, policy: PolicyVersion) -> None:
        if policy.kind == "lora" and importlib.util.find_spec("peft") is None:
            raise UnsupportedCapability(self.name, "lora", "install peft (pip install 'loom[lora]')")
        with self._load_lock:
            if self._loaded == (policy.version, str(policy.path)):
                return  # several groups asked for the same new version: it is loaded once
            name = f"policy version {policy.version}" + (
                f" of namespace {policy.namespace!r}" if policy.namespace else ""
            )
            key = (policy.version, policy.namespace, str(policy.path))
            model = self.versions.take(key)
            if model is None:
                model = self._read_policy(policy, name)
            with self._exclusive():
                if self.versions.max_bytes > 0:  # the version going out stays at hand (``versions``)
                    self.versions.put(self._held_key(), self.model)
                self.model = model
                self.scheduler.decode.forget()  # CUDA graphs captured on the old weights
                self._clear_prefixes()
                self.policy_version, self.policy_namespace = policy.version, policy.namespace
            self._loaded = (policy.version, str(policy.path))
        log.info("loaded policy version %d from %s", policy.version, policy.path)

    def _held_key(self) -> tuple[int, str | None, str]:
        """The ``versions`` key of the model held now (version 0: the engine's own checkpoint)."""
        if self._loaded is None or self.policy_version == 0:
            return (0, None, str(self.model_path))
        return (self._loaded[0], self.policy_namespace, self._loaded[1])

    def _read_policy(self, policy: PolicyVersion, name: str) -> Any:
        """The version's model, checked: a typed ``PolicyLoadError`` that names no path otherwise."""
        try:
            # sizes and shapes from the files' text before anything is allocated (a version
            # published before the store checked them, or a registered folder changed since)
            check_lora_base(policy.kind, policy.meta)
            folder = Path(policy.path)
            weights = [p.name for p in folder.glob("*.safetensors")]
            check_checkpoint(folder, weights, policy.kind, self._bounds())
            with MODEL_LOADS:  # one checkpoint at a time per process (loom.runtime)
                if policy.kind == "lora":  # merged into the engine's base (model.load_adapter)
                    model = load_adapter(policy.path, self.model_path, self.device)
                else:
                    model = load_model(policy.path, self.device)
            model = model.to(getattr(torch, self.dtype))  # published in float32: the engine's dtype
            attention = check_model(model)
            if attention != self.attention:  # the capabilities and the decode masks are the base's
                raise ValueError(f"the version changes the architecture ({attention})")
        except Exception as exc:  # noqa: BLE001 (any failure: a typed answer; its text names paths)
            log.warning("could not load %s from %s: %s: %s", name, policy.path, type(exc).__name__, exc)
            reason = (
                exc.detail
                if isinstance(exc, CheckpointRefused)
                else "its files are not a checkpoint this engine serves"
            )
            raise PolicyLoadError(f"could not load {name}: {reason}") from None
        return model

    async def adapted(self, adapter: str) -> TorchEngine:
        return await asyncio.to_thread(self.adapted_sync, adapter)

    def adapted_sync(self, adapter: str) -> TorchEngine:
        """A view of this engine serving the LoRA adapter in the folder ``adapter`` (``loom engine``'s
        runtime adapters): its requests decode in this engine's batches with their own adapter
        (``LoraView``); this engine is untouched. The adapter's tensors must be LoRA
        factors of this base's projections (``check_lora``), checked from the files' headers first."""
        return self._view(Path(adapter), self.policy_version, self.policy_namespace)

    async def lora_view(self, policy: PolicyVersion) -> TorchEngine:
        """A view serving the LoRA version ``policy`` of this engine's base (``adapted_sync``): its
        record must declare that base (``check_lora_base``). Views are kept (as many as adapters)
        with their prefix caches, so the next group of the version finds its prefixes."""
        key = (policy.version, policy.namespace, str(policy.path))
        view = self._views.get(key)
        if view is None:
            view = await asyncio.to_thread(
                self._view, Path(policy.path), policy.version, policy.namespace, policy.meta
            )
            self._views[key] = view
            while len(self._views) > self.lora.max_adapters:
                self._views.popitem(last=False)
        self._views.move_to_end(key)
        return view

    def _view(
        self, folder: Path, version: int, namespace: str | None, meta: dict[str, Any] | None = None
    ) -> TorchEngine:
        if importlib.util.find_spec("peft") is None:
            raise UnsupportedCapability(self.name, "lora", "install peft (pip install 'loom[lora]')")
        try:
            check_lora_base("lora", meta or {})
            check_checkpoint(folder, [p.name for p in folder.glob("*.safetensors")], "lora", self._bounds())
            return LoraView.of(self, folder, version, namespace)
        except (UnsupportedCapability, PolicyLoadError):
            raise
        except Exception as exc:  # noqa: BLE001 (any failure: a typed answer; its text names paths)
            log.warning("could not load the adapter %s: %s: %s", folder, type(exc).__name__, exc)
            reason = (
                exc.detail
                if isinstance(exc, CheckpointRefused)
                else "its files are not a LoRA adapter of this engine's base model"
            )
            raise PolicyLoadError(reason) from None

    def lora_adapter(self, folder: Path) -> LoraAdapter:
        """The adapter's factors from the LRU (read when not held), with its hooks on the model
        (added while the engine is held). Never called with the engine held."""
        if self.cuda_graphs:  # a captured graph would replay one batch's adapters for every batch
            raise UnsupportedCapability(self.name, "lora", "LoRA views decode without CUDA graphs")
        adapter = self.lora.get(folder, self.model, self.device, getattr(torch, self.dtype))
        if not self.lora.hooked(self.model, adapter):
            with self._exclusive():
                self.lora.hook(self.model, adapter)
        return adapter

    async def close(self) -> None:
        await asyncio.to_thread(self.stop_scheduler)

    async def reset_cache(self) -> None:
        await asyncio.to_thread(self.reset_cache_sync)

    def reset_cache_sync(self) -> None:
        with self._exclusive():
            self._clear_prefixes()

    def _clear_prefixes(self) -> None:
        """This engine's prefix cache and its LoRA views' (their keys and values are of its model)."""
        self.prefix.clear()
        for view in list(self.view_refs):
            view.prefix.clear()

    def stop_scheduler(self, timeout: float = 5.0) -> None:
        """Let an idle scheduler thread end now and wait for it (interpreter shutdown calls it)."""
        self.scheduler.stop(timeout)

    # ---------------------------------------------------------------------------------------------
    # the parts the scheduler and the single-request path share

    def require(self, capability: Capability, hint: str = "") -> None:
        """``Engine.require``, with the reason when the model itself rules a capability out (the
        group layout on a sliding-window model: ``loom.architectures.Attention.refuse_layout``)."""
        if capability == "group_positions" and self.attention.windowed:
            try:
                self.attention.refuse_layout(f"engine {self.name!r}")
            except UnsupportedModel as exc:
                raise UnsupportedCapability(
                    self.name, capability, f"{exc}; {hint}" if hint else str(exc)
                ) from exc
        super().require(capability, hint)

    def _fit(self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None) -> SamplingParams:
        """Refuse a prompt the model cannot read (``base.check_prompt``: ``InvalidPrompt``) and cap
        ``max_tokens`` at the room its context leaves, so a sample that reaches the end of the context
        ends with finish_reason "length". (vLLM answers 400 to prompt + max_tokens > max_model_len;
        the torch engine, and so ``loom engine``, serves what fits.) Under a group layout positions
        are numbered per group, and the generated tokens continue ``gen_group``'s."""
        if layout is not None:  # a model can rule the layout out (``require``)
            self.require("group_positions")
        if layout is not None and len(layout.groups) != len(prompt_ids):
            raise ValueError(f"layout has {len(layout.groups)} groups for {len(prompt_ids)} prompt tokens")
        check_sampling(params, self.vocab_size)
        limit = self.max_model_len
        if layout is None:
            room = check_prompt(prompt_ids, self.vocab_size, limit)
        else:
            check_prompt(prompt_ids, self.vocab_size, None)
            room = self.room(prompt_ids, layout)
            if room == 0:
                raise InvalidPrompt(
                    f"a group of the prompt's layout takes {max(Counter(layout.groups).values())} "
                    f"positions; the model's context holds {limit} (and at least one generated token)"
                )
        if room is not None and params.max_tokens > room:
            return params.model_copy(update={"max_tokens": room})
        return params

    def _submit(
        self, prompt_ids: list[int], params: SamplingParams, listener: Listener | None = None
    ) -> Future[list[Completion]]:
        return self.scheduler.submit(prompt_ids, params, listener)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self.scheduler.exclusive():
            yield

    def _prefill_rows(
        self, key: Key, groups: list[int], masked: bool, n: int
    ) -> tuple[Any, torch.Tensor, int]:
        """Prefill ``key`` past its longest cached prefix; the cache and next-token logits as n rows,
        and how many of its tokens the cache served."""
        cache, reuse = self.prefix.take(key)
        self.stats.requests += 1
        self.stats.cached_tokens += reuse
        self.stats.prefill_tokens += len(key) - reuse
        x = torch.tensor([[t for t, _ in key[reuse:]]], device=self.device)
        logits = self._forward(x, groups, reuse, cache, masked)
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits = logits.expand(n, -1)
        return cache, logits, reuse

    def _prefill_batch(self, keys: list[Key], ns: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Prefill plain prompts that have nothing cached in ONE forward, left-padded; their cache,
        next-token logits and attention mask (1 = a real token) as ``ns[i]`` rows each. The pads'
        keys and values are zeroed (a fully masked pad query may hold anything)."""
        from transformers import DynamicCache

        width = max(len(k) for k in keys)
        ids = torch.zeros(len(keys), width, dtype=torch.long)
        mask = torch.zeros(len(keys), width, dtype=torch.long)
        for i, key in enumerate(keys):
            ids[i, width - len(key) :] = torch.tensor([t for t, _ in key])
            mask[i, width - len(key) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = self.model(
            ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()
        self.stats.requests += len(keys)
        self.stats.prefill_tokens += sum(len(k) for k in keys)
        pads = (mask == 0)[:, None, :, None]
        for k, v in layers(cache):
            k.masked_fill_(pads, 0)
            v.masked_fill_(pads, 0)
        if any(n > 1 for n in ns):
            rows = torch.arange(len(keys), device=self.device).repeat_interleave(
                torch.tensor(ns, device=self.device)
            )
            cache.batch_select_indices(rows)
            logits, mask = logits[rows], mask[rows]
        return cache, logits, mask

    def _forward(self, ids: torch.Tensor, groups: list[int], start: int, cache: Any, masked: bool) -> Any:
        positions = group_positions(groups)[start:]
        kwargs: dict[str, Any] = {
            "position_ids": torch.tensor([positions], device=self.device).expand(ids.shape[0], -1),
            "past_key_values": cache,
            "use_cache": True,
        }
        if masked:
            kwargs["attention_mask"] = block_mask(
                groups, start, getattr(torch, self.dtype), self.device
            ).expand(ids.shape[0], -1, -1, -1)
        return self.model(ids, **kwargs).logits[:, -1, :].float()

    def _sample(
        self,
        logits: torch.Tensor,
        params: SamplingParams,
        gen: torch.Generator,
        prompt_ids: list[int] | None = None,
        outputs: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sample(logits, params, gen, self.logprobs_kind, self.eos_ids, prompt_ids, outputs)

    def _accept(
        self, c: Completion, t: int, lp: float, top: Any, r: int, params: SamplingParams, stop_ids: set[int]
    ) -> bool:
        return accept(c, t, lp, top, r, params, stop_ids, self.eos_ids, self.tokenizer)


# -------------------------------------------------------------------------------------------------
# LoRA views (docs/interop-engine.md "Multi-LoRA")


class LoraView(TorchEngine):
    """A ``TorchEngine`` serving one LoRA adapter of its base engine's model, sharing that engine's
    weights, batching scheduler and lock (``lora``: every row its own adapter); made by
    ``TorchEngine.adapted`` / ``lora_view``.

    Its requests decode in the base's batches, beside the base's and other adapters' rows, tagged
    with the adapter; it reads the base's current model (a policy load of the base is seen at once);
    on the single-request path (group layouts, ``batching=False``) it has a prefix cache of its own,
    where the batched path keys the base's prefix cache with the adapter's tag. The adapter's factors
    are held by the base's ``LoraSet`` (an LRU); a view whose adapter was evicted reads it again at
    its next request. Loading a policy or an adapter through a view is refused."""

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
