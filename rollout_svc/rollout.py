"""The rollout core: one RolloutRequest -> one Group, on a given engine. No HTTP, no Celery.

``api.py`` (POST /v1/rollouts) and ``tasks.py`` (``rollout.generate_group``) both call
``generate_group``; engine selection and the tokenizer are the caller's (process-level singletons).
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from loom.contracts.modes import ModeLimits, parse_mode_params
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, LogprobsProcessing, PolicyVersion, RolloutRequest, SamplingParams
from loom.remote_store import open_policy_store
from rollout_svc.engines.base import Engine, EngineError, check_prompt
from rollout_svc.modes import MODES, ModeError, mode_runner


class GroupTimeout(EngineError):
    """The group's generation ran past ``LOOM_ROLLOUT_GROUP_TIMEOUT_S``: it is abandoned (its engine
    and scorer calls cancelled) so its worker slot is free; not retried (it would take as long again)."""

    kind = "group_timeout"


async def generate_group(
    request: RolloutRequest, engine: Engine, tokenizer: Callable[[], Any], settings: Settings
) -> Group:
    """Generate one prompt's group. ``tokenizer()`` is called only when text must be tokenized.
    The generation (not the policy catch-up before it, which has its own timeouts) is bounded by
    ``settings.rollout_group_timeout_s``: past it, ``GroupTimeout``."""
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
    await catch_up(engine, request.policy_version, settings)
    limit = settings.rollout_group_timeout_s
    try:
        async with asyncio.timeout(limit) as bound:
            group = await _generate(request, prompt_ids, group_id, engine, tokenizer, settings)
    except TimeoutError:
        if not bound.expired():
            raise
        raise GroupTimeout(
            f"the group took longer than {limit} s (LOOM_ROLLOUT_GROUP_TIMEOUT_S) and was abandoned"
        ) from None
    return with_text(with_processing(group, request.sampling), tokenizer)


async def _generate(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Callable[[], Any],
    settings: Settings,
) -> Group:
    params = parse_mode_params(request, ModeLimits.from_settings(settings))
    group: Group = await mode_runner(request.mode)(
        request, prompt_ids, group_id, engine, tokenizer, params, settings
    )
    return group


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


_catch_up_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


async def catch_up(engine: Engine, wanted: int | None, settings: Settings) -> None:
    """Load policy version ``wanted`` (or the newest stored one above it) when the engine is older.

    Every replica pulls the version a request asks for, so no broadcast has to reach all of them.
    The groups a replica has in flight (threads-pool tasks share one event loop, as do the API's
    requests) catch up one at a time and re-check after waiting: a new version is loaded once, not
    once per group (on vLLM, one reload per group), and a group asking for an older version never
    loads it over a newer one another group has just loaded.
    """
    if wanted is None or engine.policy_version >= wanted:
        return
    async with loop_local(_catch_up_locks, asyncio.Lock):
        if engine.policy_version < wanted:
            await _load_at_least(engine, wanted, settings)


class PolicyNotFound(LookupError):
    """No such version in the policy store (a 404 naming the version, nothing else)."""


class PolicyPathRefused(ValueError):
    """A path that is not a version directory of the policy store: never looked at, never loaded."""


def base_policy(settings: Settings) -> PolicyVersion:
    """Version 0: the model every engine starts from (``LOOM_MODEL``: ``tiny``, ``search`` or a path)."""
    from loom.models import resolve_model_path

    return PolicyVersion(version=0, path=str(resolve_model_path(settings.model)))


def stored_policy(settings: Settings, version: int | None, path: str | None = None) -> PolicyVersion:
    """The policy a load request names: a version of the policy store (None: the newest; 0: the base
    model), or ``path`` when it is one of the store's version directories (``<store>/v<N>``).
    ``PolicyPathRefused`` for any other path (decided on the path's text and the store's own
    links only, so the answer says nothing of what exists elsewhere); ``PolicyNotFound``. With
    ``LOOM_POLICY_STORE_URL`` the store is this replica's cache and a version is pulled on demand."""
    store = open_policy_store(settings)
    if path is not None:
        root = store.root.resolve()
        given = Path(os.path.normpath(root / path))  # lexically: ".." cannot climb out unseen

        def in_store(p: Path) -> bool:
            return p.parent == root and re.fullmatch(r"v\d+", p.name) is not None

        if not in_store(given) or not in_store(given.resolve()):  # a link in the store may point out
            raise PolicyPathRefused("path must be a version directory of the policy store (<store>/v<N>)")
        if version is not None and version != int(given.name[1:]):
            raise PolicyPathRefused(f"path is version {given.name[1:]} of the store, not {version}")
        version = int(given.name[1:])
    if version == 0:
        return base_policy(settings)
    found = store.latest() if version is None else store.get(version)
    if found is None:
        raise PolicyNotFound(
            "the policy store holds no version" if version is None else f"no policy version {version}"
        )
    return found


async def _load_at_least(engine: Engine, wanted: int, settings: Settings) -> None:
    # with LOOM_POLICY_STORE_URL this pulls the version into the local cache first (off the loop)
    store = open_policy_store(settings)
    policy = await asyncio.to_thread(store.serving, wanted)
    if policy is None:
        raise ModeError(f"policy version {wanted} is not in the policy store at {store.root}")
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
