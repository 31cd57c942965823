"""Reward-service settings (env prefix ``LOOM_REWARD_``): verifier pool and request limits.

In the contract package because the gateway checks a submission's reward spec against the same
operator bound (``max_timeout_s``) without importing the reward service."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class JudgeServer(BaseModel):
    """One operator-configured judge (docs/interop-reward.md "Judge rewards"): a request names it,
    never its URL (docs/security-workers.md: workers call no URL from a request)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="root of an OpenAI-compatible server (its /v1/completions is called)")
    model: str = ""
    max_concurrency: int = Field(default=8, ge=1, le=1024, description="requests in flight at once")
    rpm: int = Field(default=0, ge=0, description="requests per minute (token bucket); 0 = unlimited")
    tpm: int = Field(default=0, ge=0, description="prompt+completion tokens per minute; 0 = unlimited")
    retries: int = Field(default=3, ge=0, le=10, description="retries on 429, 5xx and connect errors")
    backoff_s: float = Field(default=0.5, gt=0, le=30, description="first retry's wait (doubled, capped 8x)")


class RewardSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_REWARD_", extra="ignore")

    pool: Literal["threads", "prefork"] = Field(
        default="threads",
        description="reward workers' Celery pool: threads (math-verify runs in the task's own forked "
        "verifier processes either way; prefork adds a pipe hop of the whole group per task)",
    )
    workers: int = Field(default=2, ge=1, description="verification worker processes per API/Celery process")
    sandbox_url: str = Field(
        default="", description="the sandbox service code rewards run in; empty: the settings' sandbox port"
    )
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
    # fairness (reward_svc/pool.py, docs/security-workers.md)
    spare_workers: int = Field(
        default=2,
        ge=0,
        description="verifier processes forked beyond `workers` while some are stuck on slow items, each "
        "for a request with no slow item of its own, so one request's hostile items do not hold up another",
    )
    slow_item_s: float = Field(
        default=0.5, gt=0, description="an item running this long marks its worker slow (see spare_workers)"
    )
    max_timeout_s: int = Field(
        default=30,
        ge=1,
        le=300,
        description="the largest per-item verification deadline (`timeout_s`) a request may ask for; "
        "more is a 422",
    )
    judges: dict[str, JudgeServer] = Field(
        default_factory=dict,
        description="LOOM_REWARD_JUDGES, JSON {name: {url, model, max_concurrency, rpm, tpm}}: the judges "
        "the judge component may name",
    )
    max_items: int = Field(default=4096, ge=1, description="trajectories per request; more is a 413")
    max_chars: int = Field(
        default=200_000,
        ge=1,
        description="characters per text field; a longer one is its item's invalid status",
    )


@lru_cache(maxsize=1)
def get_reward_settings() -> RewardSettings:
    return RewardSettings()
