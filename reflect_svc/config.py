"""Reflect-service settings (env prefix ``LOOM_REFLECT_``): transport, reflection model, tokenizer."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class ReflectSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_REFLECT_", extra="ignore")

    transport: Literal["queue", "http"] = Field(
        default="queue", description="reach rollout/reward by their Celery tasks or their HTTP APIs"
    )
    rollout_url: str = Field(default="", description="http transport; empty = the settings' rollout URL")
    reward_url: str = Field(default="", description="http transport; empty = the settings' reward URL")
    model_url: str = Field(
        default="", description="reflection model server (OpenAI-compatible); empty = none"
    )
    model_name: str = ""
    model_endpoint: Literal["completions", "chat"] = "completions"
    model_top_logprobs: int = Field(default=5, ge=1, le=20)
    model_tokens_per_chunk: int = Field(default=10, ge=4, description="label budget per chunk")
    model_timeout_s: float = Field(default=120.0, gt=0)
    tokenizer: str = Field(default="", description="the policy's tokenizer; empty = LOOM_MODEL ('tiny')")
    subtask_timeout_s: float = Field(default=600.0, gt=0, description="wait for a rollout/reward task")
    parallel: int = Field(default=4, ge=1, description="rollout requests in flight per group")
    match_batch_texts: int = Field(
        default=4096, ge=1, description="chunks per verifier (match) request: the reward service's cap"
    )
    match_batch_chars: int = Field(
        default=1_000_000, ge=1, description="characters per verifier request (its body limit is 16 MiB)"
    )


@lru_cache(maxsize=1)
def get_reflect_settings() -> ReflectSettings:
    return ReflectSettings()
