"""Sandbox-service settings (env prefix ``LOOM_SANDBOX_``): the pool's size and the service's maximum
limits (a request's limits are capped at these; docs/sandbox.md)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from loom.contracts.sandbox import Limits, SessionLimits


class SandboxSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_SANDBOX_", extra="ignore")

    slots: int = Field(default=2, ge=1, description="warm runner slots: runs at once per process")
    queue: int = Field(default=128, ge=0, description="admitted runs waiting for a slot; beyond: 429 busy")
    grace_s: float = Field(default=5.0, gt=0, description="past a run's wall time, its slot is replaced")
    python: str = Field(
        default="/usr/bin/python3",
        pattern=r"^/usr/",
        description="Python runs' interpreter (only /usr is bound)",
    )
    bwrap: str = Field(default="", description="the bubblewrap binary; empty: /usr/bin/bwrap")
    max_cpu_s: float = Field(default=60.0, gt=0)
    max_wall_s: float = Field(default=120.0, gt=0)
    max_memory_mb: int = Field(default=4096, ge=16)
    max_processes: int = Field(default=256, ge=1)
    max_open_files: int = Field(default=1024, ge=8)
    max_output_bytes: int = Field(default=16 << 20, ge=1024)
    max_tmp_mb: int = Field(default=512, ge=1)
    sessions: int = Field(default=8, ge=1, description="interpreter sessions at once; beyond: 429 busy")
    max_session_cpu_s: float = Field(default=600.0, gt=0, le=3600)
    max_session_wall_s: float = Field(default=3600.0, gt=0, le=86400)
    max_session_idle_s: float = Field(default=3600.0, gt=0, le=86400)
    max_session_calls: int = Field(default=10_000, ge=1, le=100_000)

    def max_limits(self) -> Limits:
        return Limits(
            cpu_s=self.max_cpu_s,
            wall_s=self.max_wall_s,
            memory_mb=self.max_memory_mb,
            processes=self.max_processes,
            open_files=self.max_open_files,
            output_bytes=self.max_output_bytes,
            tmp_mb=self.max_tmp_mb,
        )

    def max_session(self) -> SessionLimits:
        return SessionLimits(
            cpu_budget_s=self.max_session_cpu_s,
            wall_budget_s=self.max_session_wall_s,
            idle_ttl_s=self.max_session_idle_s,
            max_calls=self.max_session_calls,
        )


@lru_cache(maxsize=1)
def get_sandbox_settings() -> SandboxSettings:
    return SandboxSettings()
