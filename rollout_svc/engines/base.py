"""The engine interface: token-in/token-out generation that every rollout mode is written against.

An engine continues a token prompt with ``SamplingParams`` (n, seed, temperature/top-p/top-k, stop
strings, stop token ids, top-k log-probs) and returns, per sample, the token ids, the log-prob of each
sampled token, optional top-k log-probs and why it stopped. Engines differ in capabilities: only the
torch engine takes group position ids / block attention masks (StreamingThinker layout) or returns
attention scores; a mode that needs one calls ``require`` and gets a typed ``UnsupportedCapability``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from loom.contracts.wire import PolicyVersion, SamplingParams
from loom.vocab import outside_vocabulary

# stop_sequences: SamplingParams.stop_token_sequences (a marker that is several tokens, exact on ids)
Capability = Literal["group_positions", "attention_scores", "prefix_cache", "lora", "stop_sequences"]


class EngineError(RuntimeError):
    """Base of every engine failure; ``kind`` is a stable machine-readable name."""

    kind = "engine_error"


class EngineUnavailable(EngineError):
    """The engine could not be reached or answered 5xx after every retry."""

    kind = "engine_unavailable"


class EngineTimeout(EngineError):
    kind = "engine_timeout"


class EngineRequestError(EngineError):
    """The engine refused the request (4xx): a bug or a limit of the engine, not worth retrying."""

    kind = "engine_request_error"


class InvalidPrompt(EngineRequestError):
    """The prompt does not fit the model: a token id outside its vocabulary, or more tokens than its
    context holds. Bad input (a 422 at the API, no retry in a task); ``field`` names the request field."""

    kind = "invalid_prompt"

    def __init__(self, message: str, field: str = "prompt_ids") -> None:
        self.field = field
        super().__init__(message)

    def __reduce__(self) -> tuple[type[InvalidPrompt], tuple[str, str]]:
        return type(self), (str(self), self.field)  # crosses ProcessEngine's pipe


class PolicyLoadError(EngineRequestError):
    """A checkpoint could not be loaded (no such directory, not a model the loader recognises)."""

    kind = "load_failed"


def _check_ids(ids: list[int], vocab_size: int | None, field: str) -> None:
    """``InvalidPrompt`` for no ids or an id outside the vocabulary; ``field`` names the request field
    (a list of ids is indexed, ``token i of prompt`` for a text the engine tokenized)."""
    if not ids:
        raise InvalidPrompt(f"{field} must not be empty", field)
    if vocab_size is not None and (i := outside_vocabulary(ids, vocab_size)) is not None:
        where = f"{field}[{i}]" if field.endswith("_ids") else f"token {i} of {field}"
        raise InvalidPrompt(f"{where} = {ids[i]} is outside the model's vocabulary [0, {vocab_size})", field)


def check_prompt(
    prompt_ids: list[int], vocab_size: int | None, max_model_len: int | None, field: str = "prompt_ids"
) -> int | None:
    """Refuse a prompt the model cannot read (``InvalidPrompt``); return how many tokens it leaves
    room for (None: unknown). Like vLLM, a prompt must leave room for at least one generated token."""
    _check_ids(prompt_ids, vocab_size, field)
    if max_model_len is None:
        return None
    if len(prompt_ids) >= max_model_len:
        raise InvalidPrompt(
            f"{field} has {len(prompt_ids)} tokens; the model's context holds {max_model_len} "
            "(prompt and at least one generated token)",
            field,
        )
    return max_model_len - len(prompt_ids)


def check_sampling(params: SamplingParams, vocab_size: int | None) -> None:
    """Refuse sampling fields that name a token outside the vocabulary (``InvalidPrompt`` naming the
    field): ``logit_bias``, ``allowed_token_ids``. (``stop_token_ids`` never index the logits.)"""
    if vocab_size is None:
        return
    named = (("logit_bias", list(params.logit_bias)), ("allowed_token_ids", params.allowed_token_ids))
    for name, ids in named:
        if ids and (i := outside_vocabulary(ids, vocab_size)) is not None:
            raise InvalidPrompt(
                f"{name} names token {ids[i]}, outside the model's vocabulary [0, {vocab_size})", name
            )


def check_scored(
    token_ids: list[int], n_steps: int, vocab_size: int | None, max_model_len: int | None, max_steps: int
) -> None:
    """Refuse a sequence the attention scorer cannot read (``InvalidPrompt``): ids outside the
    vocabulary, more tokens than the context, more steps than the scorer's bound. Checked before the
    model sees it: on CUDA an out-of-range index is a device-side assert that leaves the process's
    CUDA context unusable for every later request."""
    _check_ids(token_ids, vocab_size, "token_ids")
    if max_model_len is not None and len(token_ids) > max_model_len:
        raise InvalidPrompt(
            f"token_ids has {len(token_ids)} tokens; the model's context holds {max_model_len}", "token_ids"
        )
    if n_steps > max_steps:
        raise InvalidPrompt(f"{n_steps} steps; the scorer takes at most {max_steps}", "steps")


class UnsupportedCapability(EngineError):
    """A mode asked for something this engine cannot do (e.g. group positions on vLLM)."""

    kind = "unsupported_capability"

    def __init__(self, engine: str, capability: str, hint: str = "") -> None:
        self.engine = engine
        self.capability = capability
        self.hint = hint
        msg = f"engine {engine!r} does not support {capability!r}"
        super().__init__(f"{msg}; {hint}" if hint else msg)

    def __reduce__(self) -> tuple[type[UnsupportedCapability], tuple[str, str, str]]:
        return type(self), (self.engine, self.capability, self.hint)  # crosses ProcessEngine's pipe


@dataclass
class Completion:
    """One sample: ``token_ids`` (stop token included), aligned ``logprobs``, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"] = "stop"
    stop_reason: str | int | None = None  # the stop string / stop token id; None for EOS or length
    top_logprobs: list[dict[int, float]] | None = None
    cached_tokens: int = 0  # prompt tokens of its request served from the prefix cache (same on all n)


@dataclass
class Progress:
    """One step of a streamed sample: ``completion`` (the engine's own object, still growing) holds
    ``tokens`` tokens (and as many log-probs) so far; ``ended``: it is complete, finish reason set."""

    sample: int
    completion: Completion
    tokens: int
    ended: bool


Listener = Callable[[Progress], None]
PromptLogprobs = list[dict[int, tuple[float, int]] | None]  # see Engine.prompt_logprobs


@dataclass
class Layout:
    """Optional group layout of the prompt (torch engine only).

    ``groups[i]`` is the group of prompt token i; generated tokens get ``gen_group``. Positions are
    numbered from 0 within each group; a token sees earlier tokens whose group is <= its own
    (source = 0 sees only source, target = 1 sees both): StreamingThinker's block visibility.
    """

    groups: list[int]
    gen_group: int = 1


@dataclass
class EngineStats:
    prefill_tokens: int = 0  # prompt tokens actually computed (not served from a prefix cache)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    decode_tokens: int = 0
    requests: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class Engine(ABC):
    name: str = "engine"
    capabilities: frozenset[str] = frozenset()
    logprobs_kind: Literal["raw", "processed"] = "raw"
    batches_loras = False  # ``lora_view`` serves LoRA versions beside the engine's own (torch)

    def __init__(self) -> None:
        self.policy_version = 0
        self.policy_namespace: str | None = None  # with policy_version, the policy's identity
        self.stats = EngineStats()

    @property
    def vocab_size(self) -> int | None:
        """Token ids are in [0, vocab_size); None: unknown here (the engine's server checks)."""
        return None

    @property
    def max_model_len(self) -> int | None:
        """Positions the model holds, prompt and generated tokens together; None: unknown here."""
        return None

    def room(self, prompt_ids: list[int], layout: Layout | None = None) -> int | None:
        """Tokens the context leaves for generation after ``prompt_ids`` (0: full; None: unknown).
        Under a group layout positions are numbered per group: generated tokens continue
        ``gen_group``'s, and no group may outgrow the context. A mode that extends its own sequence
        (streaming rounds, a spawn parent after its join) asks this before each call and ends the
        sample with finish_reason "length" at 0, as a single call does at the context's end."""
        limit = self.max_model_len
        if limit is None:
            return None
        if layout is None:
            return max(0, limit - len(prompt_ids))
        counts = Counter(layout.groups)
        if counts and max(counts.values()) > limit:
            return 0
        return max(0, limit - counts.get(layout.gen_group, 0))

    def require(self, capability: Capability, hint: str = "") -> None:
        if capability not in self.capabilities:
            raise UnsupportedCapability(self.name, capability, hint)

    @abstractmethod
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        """``params.n`` continuations of ``prompt_ids`` (never an empty prompt)."""

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Progress]:
        """``generate`` as it happens: a ``Progress`` per sample per token where the engine can stream
        (the torch engine); here, each sample once, whole (``ended``), when the call returns."""
        for i, c in enumerate(await self.generate(prompt_ids, params)):
            yield Progress(i, c, len(c.token_ids), True)

    async def prompt_logprobs(self, token_ids: list[int], k: int) -> PromptLogprobs:
        """vLLM's prompt log-probs: for each position after the first, ``{token id: (log-prob,
        rank)}`` of the token there and of the ``k`` most likely ones (raw log-probs, rank 1 = most
        likely); None at position 0. Needs the model's own forward pass (the torch engine)."""
        raise UnsupportedCapability(
            self.name, "prompt_logprobs", "prompt log-probs need the torch engine (`loom engine`)"
        )

    @abstractmethod
    async def load_policy(self, policy: PolicyVersion) -> None:
        """Load ``policy`` (full checkpoint or LoRA adapter) and drop every cached prefix."""

    async def adapted(self, adapter: str) -> Engine:
        """A new engine serving this one's model with the LoRA adapter in the folder ``adapter``
        merged (``loom engine``'s runtime adapters, each served under its own name); this engine is
        left as it is. Needs the model's weights in process (the torch engine)."""
        raise UnsupportedCapability(self.name, "lora", "runtime adapters by name need the torch engine")

    async def lora_view(self, policy: PolicyVersion) -> Engine | None:
        """An engine serving the LoRA version ``policy`` beside what this one holds, its requests
        batched with this engine's (the torch engine: ``torch.lora``); None where versions are
        loaded one at a time (``load_policy``)."""
        return None

    @abstractmethod
    async def reset_cache(self) -> None: ...

    async def close(self) -> None:
        return None

    async def score_attention(
        self, token_ids: list[int], steps: list[tuple[int, int]], delta: int = 4, zero_from: int | None = None
    ) -> list[float]:
        """FCI score of each step span of ``token_ids`` (``loom.fci``); needs ``attention_scores``."""
        raise UnsupportedCapability(
            self.name,
            "attention_scores",
            "the operator's LOOM_ATTENTION_URL names a learner or `loom engine` serving /v1/score/attention",
        )
