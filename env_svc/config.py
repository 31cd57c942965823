"""Env-worker settings (env prefix ``LOOM_ENV_``; docs/environments.md "Settings"). What the rollout
side needs too (open timeout, grace, the modules of a deployment's own environments) is in
``loom.contracts.settings.Settings``."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EnvSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_ENV_", extra="ignore")

    sandbox_url: str = Field(
        default="",
        description="the sandbox API the python environment opens sessions on; empty: the settings' "
        "sandbox port",
    )
    concurrency: int = Field(
        default=16, ge=1, description="tasks (opens, steps, closes) at once per worker, when -c is not given"
    )
    result_expires_s: float = Field(
        default=3600.0,
        gt=0,
        description="how long an open's or a step's result is kept (read at once by its episode; the "
        "store's 7-day default is for groups and steps of training)",
    )
    step_threads: int = Field(
        default=64,
        ge=1,
        description="threads environments' resets and steps run on (a step past its deadline keeps one "
        "until it returns; the task thread answers timeout at once)",
    )


@lru_cache(maxsize=1)
def get_env_settings() -> EnvSettings:
    return EnvSettings()
