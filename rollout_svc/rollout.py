"""The rollout core: one RolloutRequest -> one Group, on a given engine. No HTTP, no Celery.

``api.py`` (POST /v1/rollouts) and ``tasks.py`` (``rollout.generate_group``) both call
``generate_group``; engine selection and the tokenizer are the caller's (process-level singletons).
"""

from __future__ import annotations

import asyncio
import importlib
import uuid
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from loom.schemas import Group, LogprobsProcessing, RolloutRequest, SamplingParams
from loom.settings import Settings
from loom.store import PolicyStore
from rollout_svc.engines.base import Engine, check_prompt
from rollout_svc.modes import RUN_MODES, ModeError
from rollout_svc.modes.plain import plain
from rollout_svc.modes.streaming import StreamingConfig, streaming

MODES = ("plain", "streaming", *RUN_MODES)


async def generate_group(
    request: RolloutRequest, engine: Engine, tokenizer: Callable[[], Any], settings: Settings
) -> Group:
    """Generate one prompt's group. ``tokenizer()`` is called only when text must be tokenized."""
    if request.mode not in MODES:
        raise ModeError(f"mode {request.mode!r} is not served by the rollout service yet; available: {MODES}")
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
    if request.mode == "plain":
        if request.mode_params:
            raise ModeError(f"plain takes no mode_params, got {sorted(request.mode_params)}")
        group = await plain(request, prompt_ids, group_id, engine)
    elif request.mode in RUN_MODES:
        module = importlib.import_module(RUN_MODES[request.mode])
        group = await module.run(request, prompt_ids, group_id, engine, tokenizer())
    else:
        cfg = StreamingConfig.from_request(
            request, segment_cap=settings.rollout_segment_cap, reading_wpm=settings.rollout_reading_wpm
        )
        group = await streaming(request, prompt_ids, group_id, engine, tokenizer(), cfg)
    return with_text(with_processing(group, request.sampling), tokenizer)


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


async def _load_at_least(engine: Engine, wanted: int, settings: Settings) -> None:
    store = PolicyStore(settings.policy_store_path)
    policy = store.serving(wanted)
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
