"""The rollout core: one RolloutRequest -> one Group, on a given engine. No HTTP, no Celery.

``api.py`` (POST /v1/rollouts) and ``tasks.py`` (``rollout.generate_group``) both call
``generate_group``; engine selection and the tokenizer are the caller's (process-level singletons).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from loom.schemas import Group, RolloutRequest
from loom.settings import Settings
from rollout_svc.engines.base import Engine
from rollout_svc.modes import ModeError
from rollout_svc.modes.plain import plain
from rollout_svc.modes.streaming import StreamingConfig, streaming

MODES = ("plain", "streaming")


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
    if request.mode == "plain":
        if request.mode_params:
            raise ModeError(f"plain takes no mode_params, got {sorted(request.mode_params)}")
        return await plain(request, prompt_ids, group_id, engine)
    cfg = StreamingConfig.from_request(
        request, segment_cap=settings.rollout_segment_cap, reading_wpm=settings.rollout_reading_wpm
    )
    return await streaming(request, prompt_ids, group_id, engine, tokenizer(), cfg)
