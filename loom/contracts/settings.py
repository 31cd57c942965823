"""Typed settings for every Loom process, read from the environment (prefix ``LOOM_``).

One class for all services keeps names identical across the API, compose files and docs; a service
reads only the fields it needs. ``LOOM_BROKER_URL=embedded`` (the default) selects the embedded
broker and result backend that need no server (see README, "Embedded broker").
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SERVICES: tuple[str, ...] = ("gateway", "rollout", "reward", "reflect", "learner", "sandbox", "env")

TRACKERS: tuple[str, ...] = ("tensorboard", "wandb", "mlflow")

DEFAULT_PORTS: dict[str, int] = {
    "gateway": 8400,
    "rollout": 8401,
    "reward": 8402,
    "reflect": 8403,
    "learner": 8404,
    "sandbox": 8405,
    "env": 8406,
    "engine": 8410,
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LOOM_", extra="ignore")

    # --- where things live
    data_dir: Path = Field(default=Path(".loom"), description="state: embedded broker, results, runs")
    policy_store: Path | None = Field(default=None, description="policy versions; default data_dir/policy")
    policy_store_url: str = Field(
        default="",
        description="a store served over HTTP (the learner API's /v1/store, docs/operations.md): replicas "
        "pull versions into policy_cache and check each file's sha256; empty: the local policy_store",
    )
    policy_cache: Path | None = Field(
        default=None,
        description="where a replica keeps the versions it pulled (default data_dir/policy-cache)",
    )
    policy_pull_timeout_s: float = Field(
        default=600.0, gt=0, description="the longest one version's pull (manifest and files) may take"
    )

    # --- queue fabric
    broker_url: str = Field(default="embedded", description="'embedded' or amqp://user:pass@host:5672//")
    result_backend: str = Field(default="embedded", description="'embedded' or redis://host:6379/0")
    task_soft_time_limit: float = 600.0
    task_time_limit: float = 660.0
    queue_namespace: str = Field(
        default="", description="prefix of every queue/exchange name, so deployments can share a broker"
    )
    embedded_visibility_timeout: float = Field(
        default=30.0, description="seconds an unacknowledged embedded message stays invisible without a lease"
    )

    # --- HTTP
    host: str = "127.0.0.1"
    gateway_port: int = DEFAULT_PORTS["gateway"]
    rollout_port: int = DEFAULT_PORTS["rollout"]
    reward_port: int = DEFAULT_PORTS["reward"]
    reflect_port: int = DEFAULT_PORTS["reflect"]
    learner_port: int = DEFAULT_PORTS["learner"]
    sandbox_port: int = DEFAULT_PORTS["sandbox"]
    env_port: int = DEFAULT_PORTS["env"]
    engine_port: int = DEFAULT_PORTS["engine"]
    max_body_bytes: int = Field(default=16 * 1024 * 1024, description="larger request bodies get 413")
    # --- read deadlines of every Loom HTTP server (loom/service.py, docs/security.md "Read timeouts")
    header_timeout_s: float = Field(
        default=10.0, gt=0.0, description="a request's headers, from its first byte; past it: 408, closed"
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0.0, description="a request's body, from its headers (plus body_min_rate's time)"
    )
    body_min_rate: float = Field(
        default=16384.0,
        ge=0.0,
        description="bytes/s: each body_min_rate bytes received add 1 s to body_timeout_s (0: no extension)",
    )
    http_protocol: Literal["auto", "httptools", "h11"] = Field(
        default="auto", description="uvicorn's HTTP implementation (auto: httptools when installed)"
    )
    api_keys: str = Field(default="", description="comma-separated 'name:sha256hex' pairs for the gateway")
    # the gateway's own knobs (rate limits, quotas, run page logins, ...): gateway/config.py, GatewaySettings
    # --- experiment trackers (docs/trackers.md)
    trackers: str = Field(
        default="",
        description="trackers of runs that name none: comma-separated names (tensorboard, wandb, mlflow) "
        "or a JSON list of {name, project, dir, tracking_uri, samples_per_step}; a run's own 'trackers' "
        "replaces it, and takes the tracking_uri of the entry with its name",
    )

    # --- compute
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads per process")
    worker_concurrency: int = Field(default=1, ge=1)
    worker_max_tasks_per_child: int = 200
    worker_max_memory_per_child_kb: int = 2_000_000

    # --- engines
    engine: Literal["torch", "vllm"] = "torch"
    engine_url: str = Field(default="", description="OpenAI-compatible server; empty = the torch engine")
    model: str = Field(
        default="tiny",
        description="a built-in model (tiny, search, stream, reflect, deep, code: zoo/registry.py) or a "
        "model path",
    )
    device: str = "cpu"
    engine_timeout_s: float = Field(
        default=120.0, gt=0, description="per engine request: HTTP, or a call to the torch engine's process"
    )
    engine_retries: int = Field(default=3, ge=0, description="engine retries on connection errors / 5xx")
    engine_prefix_cache_entries: int = Field(default=32, ge=0, description="torch engine prefix-KV entries")
    engine_max_loras: int = Field(
        default=2,
        ge=0,
        description="`loom engine`: runtime LoRA adapters served at once (/v1/load_lora_adapter; "
        "vLLM's --max-loras; each batched beside the base); one more is refused with a 400",
    )
    engine_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="the torch engine's weights and KV cache: 'auto' is the checkpoint's own dtype on "
        "CUDA (a bf16 checkpoint runs in bf16), float32 on CPU (loom/architectures.py resolve_dtype)",
    )
    engine_logprobs_mode: Literal["raw", "processed"] = Field(
        default="raw",
        description="behaviour log-probs the engine returns: raw (the model's) or processed (after "
        "temperature, top-k, top-p). The torch engine follows it; a vLLM server's --logprobs-mode "
        "decides for vLLM (the client reads it and reports that)",
    )
    engine_process: bool = Field(
        default=True,
        description="run the torch engine in its own process (rollout_svc.engines.process): the "
        "rollout worker's Python (Celery, result store, acks) then never takes the engine's GIL; "
        "false = inside the calling process",
    )
    # the rollout service's own knobs: rollout_svc/config.py, RolloutSettings; the modes' bounds,
    # which the gateway reads too: loom/contracts/modes.py, ModeSettings (LOOM_ROLLOUT_*)
    attention_url: str = Field(
        default="",
        description="tree mode's attention scorer for engines without attention scores (vLLM): the root "
        "of a learner or `loom engine` serving POST /v1/score/attention; empty = none. An operator "
        "setting: a worker never calls a URL taken from a request",
    )
    attention_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="the longest wait for one attention-scoring call; a request's "
        "mode_params.attention_timeout_s may only shorten it",
    )

    # --- internal routes (docs/security-workers.md)
    service_token: str = Field(
        default="",
        description="shared secret of the internal routes (the rollout service's /v1/policy, the "
        "learner's /v1/train_step and /v1/score/attention): when set they need 'Authorization: Bearer "
        "<token>'; `loom up` generates one per stack when unset",
    )

    # --- the environment tier (docs/environments.md)
    env_modules: list[str] = Field(
        default_factory=list,
        description="modules whose factories agent episodes may name as environment 'module:factory' "
        "(the env workers import them); the built-in environments need none",
    )
    env_open_timeout_s: float = Field(
        default=60.0, gt=0, description="the longest an episode waits for an env worker to open its env"
    )
    env_grace_s: float = Field(
        default=10.0,
        gt=0,
        description="past a step's deadline, how long its env worker's answer is awaited before the "
        "episode's environment is reported env_lost",
    )
    env_idle_s: float = Field(
        default=900.0, gt=0, description="an env worker forgets an episode idle this long (its rollout died)"
    )

    @field_validator("attention_url", "policy_store_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        if v and (urlsplit(v).scheme not in ("http", "https") or not urlsplit(v).hostname):
            raise ValueError(f"must be an http:// or https:// URL with a host, got {v!r}")
        return v

    @field_validator("trackers")
    @classmethod
    def _tracker_names(cls, v: str) -> str:
        import json

        text = v.strip()
        entries = json.loads(text) if text.startswith("[") else [{"name": n.strip()} for n in text.split(",")]
        for e in entries:
            name = e.get("name") if isinstance(e, dict) else None
            if name not in TRACKERS and (name or text.startswith("[")):
                raise ValueError(f"unknown tracker {name!r}: one of {', '.join(TRACKERS)}")
        return v

    def service_port(self, service: str) -> int:
        return int(getattr(self, f"{service}_port"))

    def service_url(self, service: str) -> str:
        return f"http://{self.host}:{self.service_port(service)}"

    @property
    def policy_store_path(self) -> Path:
        return self.policy_store or self.data_dir / "policy"

    @property
    def policy_cache_path(self) -> Path:
        return self.policy_cache or self.data_dir / "policy-cache"

    @property
    def policy_local_root(self) -> Path:
        """Where this process finds the versions it loads: the remote store's cache, or the store."""
        return self.policy_cache_path if self.policy_store_url else self.policy_store_path

    @property
    def embedded(self) -> bool:
        return self.broker_url == "embedded"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
