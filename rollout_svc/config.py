"""The rollout service's own configuration: ``RolloutSettings``, read from ``LOOM_ROLLOUT_*``.

A new rollout knob is one field here: the API (``rollout_svc.api``, ``app.state.rollout``) and the
Celery task (``rollout_svc.tasks``) read it once and pass its values down (``generate_group``). Three
kinds of rollout values stay in the shared settings (loom/contracts/settings.py), because another
process reads them: the engine's (``LOOM_ENGINE_*``, also ``loom engine``'s), the modes' bounds
(``LOOM_ROLLOUT_SEGMENT_CAP``, ``LOOM_ROLLOUT_READING_WPM``: the gateway checks a submission against
them, ``ModeLimits``), and the worker's pool and slots (``LOOM_ROLLOUT_CONCURRENCY``, ``_READY``,
``_POOL``: ``loom.queue.worker_argv`` starts every service's worker from them).
"""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RolloutSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ROLLOUT_", extra="ignore", frozen=True)

    group_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="the longest one group's generation may take (every engine and scorer call of it): "
        "past it the group fails with 'group_timeout' and frees its worker slot (Celery's time limits "
        "do not reach the threads pool)",
    )

    torch_cuda_graphs: bool = Field(
        default=False,
        description="the torch engine on CUDA captures its batched decode step in CUDA graphs "
        "(rollout_svc/engines/torch/decode.py); ignored on CPU",
    )


GROUP_TIMEOUT_S: float = RolloutSettings.model_fields["group_timeout_s"].default


@lru_cache(maxsize=1)
def get_rollout_settings() -> RolloutSettings:
    return RolloutSettings()
