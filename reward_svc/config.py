"""Reward-service settings (env prefix ``LOOM_REWARD_``): verifier pool and request limits."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class RewardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_REWARD_", extra="ignore")

    workers: int = Field(default=2, ge=1, description="verification worker processes per API/Celery process")
    # A recycled worker loses its warm sympy / math-verify caches: on 1600 realistic items with 2
    # workers, recycling every 300 gave 0.58-0.67 of 2x one core, none 0.75-0.86 (bench/reward.py).
    # Memory is bounded by max_rss_growth_mb and the worker's address-space cap, not by this count.
    max_items_per_worker: int = Field(
        default=2000, ge=1, description="recycle a worker after this many items"
    )
    max_rss_growth_mb: int = Field(
        default=512, ge=16, description="recycle a worker whose RSS grew this much"
    )
    mem_limit_mb: int = Field(default=2048, ge=0, description="address-space headroom per worker (0 = none)")
    max_items: int = Field(default=4096, ge=1, description="trajectories per request; more is a 413")
    max_chars: int = Field(
        default=200_000,
        ge=1,
        description="characters per text field; a longer one is its item's invalid status",
    )


@lru_cache(maxsize=1)
def get_reward_settings() -> RewardSettings:
    return RewardSettings()
