"""The rollout core: one RolloutRequest -> one Group, on a given engine. No HTTP, no Celery.

``api.py`` (POST /v1/rollouts) and ``tasks.py`` (``rollout.generate_group``) both call
``generate_group``; engine selection and the tokenizer are the caller's (process-level singletons).
"""

from __future__ import annotations

import asyncio
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from loom.contracts.modes import ModeLimits, mode_params_of
from loom.contracts.policies import PolicyMatch, is_namespace
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, LogprobsProcessing, PolicyVersion, RolloutRequest, SamplingParams
from loom.store import PublishError, open_policy_store
from loom.store.layout import version_named
from rollout_svc.config import GROUP_TIMEOUT_S
from rollout_svc.engines.base import Engine, EngineError, PolicyLoadError, check_prompt
from rollout_svc.modes import MODES, ModeError, run


class GroupTimeout(EngineError):
    """The group's generation ran past ``LOOM_ROLLOUT_GROUP_TIMEOUT_S``: it is abandoned (its engine
    and scorer calls cancelled) so its worker slot is free; not retried (it would take as long again)."""

    kind = "group_timeout"


async def generate_group(
    request: RolloutRequest,
    engine: Engine,
    tokenizer: Callable[[], Any],
    settings: Settings,
    *,
    group_timeout_s: float = GROUP_TIMEOUT_S,
) -> Group:
    """Generate one prompt's group. ``tokenizer()`` is called only when text must be tokenized.
    The generation (not the policy catch-up before it, which has its own timeouts) is bounded by
    ``group_timeout_s`` (``RolloutSettings.group_timeout_s``): past it, ``GroupTimeout``."""
    if request.mode not in MODES:
        raise ModeError(
            f"mode {request.mode!r} is not served by the rollout service yet; available: {tuple(MODES)}"
        )
    group_id = request.group_id or uuid.uuid4().hex
    if request.prompt_ids is not None:
        prompt_ids = list(request.prompt_ids)
    else:
        prompt_ids = list(tokenizer().encode(request.prompt or "", add_special_tokens=False))
    if not prompt_ids:
        raise ModeError("the prompt is empty after tokenization")
    # before any work: token ids outside the vocabulary, or a prompt the context cannot hold (the
    # engines check again; the vllm client's limits are its server's, whose 400 is a 422 here)
    field = "prompt_ids" if request.prompt_ids is not None else "prompt"
    check_prompt(prompt_ids, engine.vocab_size, engine.max_model_len, field)
    limit = group_timeout_s
    at = (request.policy_version, request.policy_namespace, request.policy_match)
    async with serving(engine, settings, *at) as served:
        try:
            async with asyncio.timeout(limit) as bound:
                group = await _generate(request, prompt_ids, group_id, served, tokenizer, settings)
        except TimeoutError:
            if not bound.expired():
                raise
            raise GroupTimeout(
                f"the group took longer than {limit} s (LOOM_ROLLOUT_GROUP_TIMEOUT_S) and was abandoned"
            ) from None
        for t in group.trajectories:  # the policy held through the whole generation
            t.policy_version, t.policy_namespace = served.policy_version, served.policy_namespace
    return with_text(with_processing(group, request.sampling), tokenizer)


async def _generate(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Callable[[], Any],
    settings: Settings,
) -> Group:
    params = mode_params_of(request, ModeLimits.from_settings(settings))
    return await run(request, prompt_ids, group_id, engine, tokenizer, params, settings)


def with_processing(group: Group, sampling: SamplingParams) -> Group:
    """Record on each trajectory with 'processed' log-probs the processing behind them: every mode
    samples with the request's temperature, top-p and top-k (the learner uses the log-probs only
    when that processing is its own: learner.logprobs.behaviour_matches)."""
    processing = LogprobsProcessing(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k
    )
    for t in group.trajectories:
        if t.logprobs_kind == "processed" and t.logprobs_processing is None:
            t.logprobs_processing = processing
    return group


T = TypeVar("T")


def loop_local(store: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T], make: Callable[[], T]) -> T:
    """``store``'s object for the running event loop, made on first use (asyncio locks and semaphores
    belong to one loop; a forked child or a test starts a new one)."""
    loop = asyncio.get_running_loop()
    obj = store.get(loop)
    if obj is None:
        obj = store[loop] = make()
    return obj


def serves(
    engine: Engine, version: int | None, namespace: str | None = None, match: PolicyMatch = "at_least"
) -> bool:
    """Whether the policy ``engine`` holds answers a request for ``version`` of ``namespace``: that
    version (``match`` "exact") or a newer one of the same namespace; version 0, the base model every
    engine starts from, belongs to every namespace. No version is version 0, the deployment's base
    model, exactly (never whatever the replica loaded last, which may be another key's:
    docs/security.md "The base-model rule")."""
    if version is None:
        version, match = 0, "exact"
    if engine.policy_version != 0 and engine.policy_namespace != namespace:
        return False
    return engine.policy_version == version if match == "exact" else engine.policy_version >= version


class _Gate:
    """The groups generating on one engine (``held``) and whether a load waits for them to end."""

    def __init__(self) -> None:
        self.changed = asyncio.Condition()
        self.held = 0
        self.loading = False


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Gate] = weakref.WeakKeyDictionary()


@asynccontextmanager
async def holding_policy(
    engine: Engine,
    settings: Settings,
    version: int | None,
    namespace: str | None = None,
    match: PolicyMatch = "at_least",
) -> AsyncIterator[None]:
    """Generate under policy ``version`` of ``namespace`` (``serves``): load it first when the engine
    holds another, and keep it until the group ends. Every replica pulls the version a request asks
    for, so no broadcast has to reach all of them.

    The groups a replica has in flight (threads-pool tasks share one event loop, as do the API's
    requests) share the policy they were served by: a load waits until they end (new groups wait
    behind it), so a group never mixes two policies and its trajectories carry the one they were
    generated with, even when another group asks for another namespace or for an exact older version.
    A version is loaded once, not once per group (on vLLM, one reload per group)."""
    gate = loop_local(_gates, _Gate)
    async with gate.changed:
        while not (not gate.loading and serves(engine, version, namespace, match)):
            if gate.loading:
                await gate.changed.wait()
                continue
            gate.loading = True
            try:
                await gate.changed.wait_for(lambda: gate.held == 0)
                if not serves(engine, version, namespace, match):  # None: the base (``serves``)
                    await _load(engine, version or 0, namespace, match, settings)
            finally:
                gate.loading = False
                gate.changed.notify_all()
        gate.held += 1
    try:
        yield
    finally:
        async with gate.changed:
            gate.held -= 1
            gate.changed.notify_all()


@asynccontextmanager
async def serving(
    engine: Engine,
    settings: Settings,
    version: int | None,
    namespace: str | None = None,
    match: PolicyMatch = "at_least",
) -> AsyncIterator[Engine]:
    """The engine a group generates on, held through the group (``holding_policy``). A LoRA version
    on an engine that batches adapters beside its base (``Engine.lora_view``: the torch engine) is
    served by a view of the engine holding the base, with no load: groups of several LoRA versions
    of one base, and of the base, decode in the same batches. Any other version is loaded on the
    engine (``holding_policy``). Which replica takes a group is the broker's (a shared queue):
    a replica holds many LoRA versions at once, so a version it does not hold yet costs it an
    adapter read, not a model swap (docs/interop-engine.md "Multi-LoRA")."""
    policy = await _lora_version(engine, settings, version, namespace, match)
    if policy is not None:
        async with holding_policy(engine, settings, 0, None, "exact"):  # the base, kept meanwhile
            view = await engine.lora_view(policy)
            assert view is not None
            yield view
        return
    async with holding_policy(engine, settings, version, namespace, match):
        yield engine


async def _lora_version(
    engine: Engine, settings: Settings, version: int | None, namespace: str | None, match: PolicyMatch
) -> PolicyVersion | None:
    """The LoRA version a request names when ``engine`` would serve it by a view, else None."""
    if not version or serves(engine, version, namespace, match):
        return None
    if not engine.batches_loras:
        return None
    if namespace is not None and not is_namespace(namespace):
        raise ModeError(f"{namespace!r} is not a policy namespace")
    store = open_policy_store(settings)
    try:
        policy = await asyncio.to_thread(store.loadable, namespace, version, match)
    except PublishError as exc:
        raise PolicyLoadError(exc.detail) from None
    return policy if policy is not None and policy.kind == "lora" else None


async def catch_up(
    engine: Engine,
    wanted: int | None,
    settings: Settings,
    namespace: str | None = None,
    match: PolicyMatch = "at_least",
) -> None:
    """Load policy version ``wanted`` of ``namespace`` (``match`` "at_least": or the newest stored
    one above it) when the engine does not hold it (``holding_policy`` without the hold)."""
    async with holding_policy(engine, settings, wanted, namespace, match):
        pass


class PolicyNotFound(LookupError):
    """No such version in the policy store (a 404 naming the version, nothing else)."""


class PolicyPathRefused(ValueError):
    """A path that is not a version directory of the policy store: never looked at, never loaded."""


def base_policy(settings: Settings) -> PolicyVersion:
    """Version 0: the model every engine starts from (``LOOM_MODEL``: ``tiny``, ``search`` or a path)."""
    from zoo.registry import resolve_model_path

    return PolicyVersion(version=0, path=str(resolve_model_path(settings.model)))


def stored_policy(
    settings: Settings, version: int | None, path: str | None = None, namespace: str | None = None
) -> PolicyVersion:
    """The policy a load request names: a version of the policy store (None: the newest; 0: the base
    model), or ``path`` when it is one of the store's version directories (``<store>/v<N>``; a
    trainer's ``namespace``: ``<store>/ns/<name>/v<N>``).
    ``PolicyPathRefused`` for any other path (decided on the path's text and the store's own
    links only, so the answer says nothing of what exists elsewhere); ``PolicyNotFound``. With
    ``LOOM_POLICY_STORE_URL`` the store is this replica's cache and a version is pulled on demand."""
    if namespace is not None and not is_namespace(namespace):
        raise PolicyNotFound(f"no policy namespace {namespace!r}")
    store = open_policy_store(settings)
    if path is not None:
        named = version_named(store.namespace(namespace).root, path)
        if named is None:
            raise PolicyPathRefused("path must be a version directory of the policy store (<store>/v<N>)")
        if version is not None and version != named:
            raise PolicyPathRefused(f"path is version {named} of the store, not {version}")
        version = named
    if version == 0:
        return base_policy(settings)
    found = store.find(namespace, version, "exact")
    if found is None:
        raise PolicyNotFound(
            "the policy store holds no version" if version is None else f"no policy version {version}"
        )
    return found


async def _load(
    engine: Engine, wanted: int, namespace: str | None, match: PolicyMatch, settings: Settings
) -> None:
    if namespace is not None and not is_namespace(namespace):
        raise ModeError(f"{namespace!r} is not a policy namespace")
    if wanted == 0:
        policy: PolicyVersion | None = base_policy(settings)
    else:  # off the loop: with LOOM_POLICY_STORE_URL this pulls the version into the local cache
        store = open_policy_store(settings)
        try:
            policy = await asyncio.to_thread(store.loadable, namespace, wanted, match)
        except PublishError as exc:  # a registered path changed since it was hashed
            raise PolicyLoadError(exc.detail) from None
    if policy is None:
        where = "the policy store" if namespace is None else f"policy namespace {namespace!r}"
        raise ModeError(f"policy version {wanted} is not in {where}")
    await engine.load_policy(policy)


def with_text(group: Group, tokenizer: Callable[[], Any]) -> Group:
    """Fill each trajectory's derived ``text`` (token ids stay the truth). Special tokens such as
    the streaming markers are kept, since format rewards read them; pad/EOS are dropped."""
    missing = [t for t in group.trajectories if t.text is None]
    if not missing:
        return group
    tok = tokenizer()
    specials = (getattr(tok, "eos_token_id", None), getattr(tok, "pad_token_id", None))
    drop = {i for i in specials if i is not None}
    for t in missing:
        t.text = tok.decode([i for i in t.completion_ids if i not in drop], skip_special_tokens=False)
    return group
