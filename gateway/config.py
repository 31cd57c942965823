"""The gateway's one configuration: ``GatewaySettings``, read from ``LOOM_GATEWAY_*``.

A new gateway knob is one field here: ``gateway.api.build_app`` reads it once and hands it to what
needs it (the rate limits to the auth middleware, the quotas to ``Quotas``, the run page's login
limits to ``WebAuth``, ``run_loop`` to the submit path). What other processes read too stays in the
shared settings (loom/contracts/settings.py): the port, the API keys, and the policy store's publish
limits (``LOOM_GATEWAY_POLICY_*``), which the store's host enforces when the gateway forwards an upload.
Quotas and limits are per API key or client address (docs/security.md).
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_GATEWAY_", extra="ignore", frozen=True)

    rate: float = Field(default=20.0, gt=0.0, description="requests/s per API key (token bucket)")
    burst: int = Field(default=40, ge=1, description="token bucket size per API key")
    max_queue_depth: int = Field(
        default=1000, ge=0, description="submissions get 429 while a pipeline queue holds more messages"
    )
    run_loop: bool = Field(default=True, description="drive RL runs in this gateway process")
    # --- quotas per API key (docs/security.md): generous for a trainer's work, refuse the absurd
    quota_jobs: int = Field(default=64, ge=1, description="queued + running jobs per key")
    quota_runs: int = Field(default=4, ge=1, description="queued + running runs per key")
    quota_samples: int = Field(
        default=2**21,
        ge=1,
        description="completions in flight per key: a job's prompts x n (adaptive: x M x R), a run's "
        "(staleness + 1) x batch x n",
    )
    quota_tokens: int = Field(
        default=2**32, ge=1, description="completion tokens in flight per key: samples x max_tokens"
    )
    max_run_samples: int = Field(
        default=2**30, ge=1, description="a run's samples over all its steps: steps x batch x n"
    )
    quota_streams: int = Field(default=32, ge=1, description="open event streams per key")
    quota_dataset_bytes: int = Field(
        default=4 * 1024**3,
        ge=1,
        description="bytes of datasets a key stores (its uploads and its runs' inline JSONL); "
        "DELETE /v1/datasets/{id} frees them",
    )
    quota_datasets: int = Field(default=256, ge=1, description="datasets a key stores")
    auth_fail_rate: float = Field(
        default=1.0, gt=0.0, description="failed authentications/s per client address (token bucket)"
    )
    auth_fail_burst: int = Field(
        default=20, ge=1, description="failed authentications a client address may make at once"
    )
    # --- the run page's sessions and logins (docs/security.md)
    sessions_per_key: int = Field(
        default=32, ge=1, description="run page sessions a key holds; its new login drops its own oldest"
    )
    login_rate: float = Field(
        default=0.1, gt=0.0, description="run page logins/s per API key and per client address (token bucket)"
    )
    login_burst: int = Field(
        default=10, ge=1, description="run page logins an API key, or a client address, may make at once"
    )
    ui_origins: str = Field(
        default="",
        description="comma-separated origins (https://host[:port]) the run page's login form may be posted "
        "from besides the gateway's own Host: the public origin behind a proxy that rewrites Host",
    )
    # --- fair share of the rollout tier across keys (gateway/scheduler.py, docs/operations.md)
    rollout_window: int = Field(
        default=0,
        ge=0,
        description="generation tasks in the broker at once (published, result not read), released "
        "across keys by deficit round robin; 0 = LOOM_GATEWAY_ROLLOUT_SLOTS, else 64",
    )
    rollout_slots: int = Field(
        default=0,
        ge=0,
        description="groups the rollout replicas take at once, all of them together (each replica's "
        "pool size: its LOOM_ROLLOUT_CONCURRENCY plus its ready slots); 0 = not known",
    )
    fair_share: bool = Field(
        default=True,
        description="release generation tasks by deficit round robin across keys (false: each is "
        "published at once, first come first served in the broker)",
    )
    dataset_max_bytes: int = Field(
        default=1024**3, ge=1, description="largest dataset upload (POST /v1/datasets)"
    )
