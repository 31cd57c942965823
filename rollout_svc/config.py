"""The rollout service's own configuration: ``RolloutSettings``, read from ``LOOM_ROLLOUT_*``.

A new rollout knob is one field here: the API (``rollout_svc.api``, ``app.state.rollout``) and the
Celery task (``rollout_svc.tasks``) and ``loom worker rollout`` (the pool and its slots) read it once
and pass its values down (``generate_group``). Two kinds of rollout values stay in the shared settings
(loom/contracts/settings.py), because another process reads them: the engine's (``LOOM_ENGINE_*``,
also ``loom engine``'s) and the modes' bounds (``LOOM_ROLLOUT_SEGMENT_CAP``,
``LOOM_ROLLOUT_READING_WPM``: ``loom.contracts.modes.ModeSettings``, since the gateway checks a
submission against them, ``ModeLimits``).
``VllmSettings`` (``LOOM_VLLM_*``) are the vLLM client's and launcher's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from loom.contracts.modes import ModeSettings
from loom.contracts.settings import Settings


class RolloutSettings(ModeSettings):
    """The rollout role's settings: its own knobs and the modes' bounds it shares with the gateway."""

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
    torch_max_loras: int = Field(
        default=8,
        ge=1,
        description="LoRA adapters whose factors the torch engine holds at once (an LRU; "
        "rollout_svc/engines/torch/lora.py)",
    )
    torch_lora_bytes: int = Field(
        default=256 << 20, ge=0, description="bytes of LoRA factors the torch engine holds at most"
    )
    torch_versions_bytes: int = Field(
        default=0,
        ge=0,
        description="bytes of full policy versions the torch engine keeps after swapping them out "
        "(an LRU: a version loaded again is swapped in without a read); 0: none kept",
    )
    concurrency: int = Field(
        default=0,
        ge=0,
        description="groups a rollout worker runs at once (threads pool: the torch engine batches "
        "them); 0 = LOOM_WORKER_CONCURRENCY",
    )
    ready: int = Field(
        default=-1,
        ge=-1,
        description="groups a threads-pool rollout worker holds ready beyond the ones on its engine: "
        "they wait at the engine's door, so a finished group's slot is refilled at once, not after its "
        "result store, ack and the next delivery; -1 = as many as run at once when the engine is a "
        "server (LOOM_ENGINE_URL) or in its own process (LOOM_ENGINE_PROCESS), none for an engine "
        "inside the worker (it shares one GIL with the engine: work done ahead only slows it down)",
    )
    pool: Literal["threads", "prefork"] = Field(
        default="threads",
        description="rollout workers' Celery pool: threads (tasks wait on an engine) or prefork",
    )


class VllmSettings(BaseSettings):
    """The vLLM engine client's and launcher's knobs (``LOOM_VLLM_*``)."""

    model_config = SettingsConfigDict(env_prefix="LOOM_VLLM_", extra="ignore", frozen=True)

    pause_mode: Literal["wait", "abort"] = Field(
        default="wait",
        description="vLLM policy updates: 'wait' lets in-flight requests finish on the old weights; "
        "'abort' cuts them (the client sends them again, on the new weights)",
    )
    lora_keep: int = Field(
        default=2, ge=1, description="LoRA adapters kept loaded on vLLM (the newest); older ones are unloaded"
    )
    python: str = Field(
        default="",
        description="Python of the vLLM environment (deploy/vllm-setup.sh); empty = .venv-vllm/bin/python "
        "in the repository. Used where Loom starts vLLM itself (loom demo --engine vllm, tests, bench)",
    )


def rollout_slots(
    settings: Settings, rollout: RolloutSettings, concurrency: int | None = None
) -> tuple[int, int]:
    """(groups a rollout worker runs on its engine at once, its Celery pool size). On the threads pool
    with an engine server (``LOOM_ENGINE_URL``: vLLM, ``loom engine``), the pool holds
    ``ready`` more tasks (default: as many again) that wait at the engine's door
    (``rollout_svc.tasks.on_engine``): a finished group's slot is taken at once by a group already
    received, validated and marked started, instead of after the result store, the ack and the next
    delivery. The same for the torch engine in its own process (``LOOM_ENGINE_PROCESS``, the default).
    Not for a torch engine inside the worker: the worker's own work shares its GIL, so doing it ahead
    slows the engine as much as it saves (measured: bench/rollout.py). Prefork children each run one
    group."""
    running = concurrency or rollout.concurrency or settings.worker_concurrency
    if rollout.pool != "threads":
        return running, running
    ready = rollout.ready
    if ready < 0:
        elsewhere = settings.engine == "vllm" or bool(settings.engine_url) or settings.engine_process
        ready = running if elsewhere else 0
    return running, running + ready


GROUP_TIMEOUT_S: float = RolloutSettings.model_fields["group_timeout_s"].default


@lru_cache(maxsize=1)
def get_rollout_settings() -> RolloutSettings:
    return RolloutSettings()
