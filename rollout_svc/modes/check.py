"""Mode parameters checked without generating: the gateway calls this at submission, so a job or run
with bad ``mode_params`` is a 422 at once instead of a 201 whose work then fails in a worker."""

from __future__ import annotations

from loom.schemas import RolloutRequest
from rollout_svc.modes import ModeError
from rollout_svc.modes.spawn import SpawnConfig
from rollout_svc.modes.streaming import StreamingConfig
from rollout_svc.modes.tree import TreeConfig


def check_mode_params(
    request: RolloutRequest,
    segment_cap: int = 512,
    reading_wpm: float = 150.0,
    max_attention_timeout_s: float = 120.0,
) -> None:
    """Parse ``request.mode_params`` exactly as its mode will (the limits are the rollout settings':
    ``LOOM_ROLLOUT_SEGMENT_CAP``, ``_READING_WPM``, ``LOOM_ATTENTION_TIMEOUT_S``); ModeError names
    what is wrong."""
    if request.mode == "plain":
        if request.mode_params:
            raise ModeError(f"plain takes no mode_params, got {sorted(request.mode_params)}")
    elif request.mode == "streaming":
        StreamingConfig.from_request(request, segment_cap=segment_cap, reading_wpm=reading_wpm)
    elif request.mode == "tree":
        TreeConfig.from_request(request, max_attention_timeout_s)
    elif request.mode == "spawn":
        SpawnConfig.from_request(request)
    else:
        raise ModeError(f"unknown mode {request.mode!r}")
