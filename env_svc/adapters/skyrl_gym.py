"""skyrl-gym's environments behind Loom's protocol (docs/environments.md, "Environment libraries").

Each episode makes the library's own environment with ``skyrl_gym.make`` from its registry and drives
it through its own ``BaseTextEnv`` methods: ``init`` with the prompt (the task's question as a user
message), ``step`` with each policy turn's text (skyrl-gym's environments parse their own actions,
``<sql>...</sql>`` and the like, so Loom's parsed tool call is not theirs to read), ``close``. A
step's ``observations`` (chat messages) are rendered to the observation text
(``env_svc/adapters/common.py``), its ``reward`` and ``done`` pass through unchanged and its
``metadata`` goes to ``meta``, with the environment's ``get_metrics()`` on the last step.

The task's label is the ground truth the environments read from their ``extras`` (``reward_spec``;
AIME's ``reward_model``). Only the environments that need no network, no data download and run no
model-written code outside Loom's sandbox are offered (``SKYRL_ENVS``): ``search`` and
``searchcode`` call a retrieval server by URL, ``lcb`` executes the policy's programs in the worker's
own process. A request supplies only per-sample data (its ``options``, one model per environment);
deployment paths such as text2sql's database folder are the operator's settings (``LOOM_ENV_SKYRL_*``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from env_svc.adapters.common import json_safe, plain_messages, render
from env_svc.base import Factory
from loom.contracts.envs import EnvAction, EnvReset, EnvStep, EnvTask
from loom.contracts.wire import Contract

PREFIX = "skyrl:"


class SkyRLSettings(BaseSettings):
    """The operator's side of skyrl-gym's environments."""

    model_config = SettingsConfigDict(env_prefix="LOOM_ENV_SKYRL_", extra="ignore")

    sql_db_path: str = Field(
        default="",
        max_length=4096,
        description="text2sql's database folder (<path>/<data folder>/<db_id>/<db_id>.sqlite); "
        "empty: text2sql is not offered",
    )


class NoOptions(Contract):
    """An environment that reads nothing but the task's question and label."""

    def extras(self) -> dict[str, Any]:
        return {}


class MultiTurnOptions(NoOptions):
    max_turns: int = Field(default=5, ge=1, le=64, description="turns before the episode ends")

    def extras(self) -> dict[str, Any]:
        return {"max_turns": self.max_turns}


class SQLOptions(NoOptions):
    db_id: str = Field(pattern=r"^[A-Za-z0-9_]{1,64}$", description="the database's folder and file name")
    data: Literal["spider", "bird", "synsql"] = "spider"
    max_turns: int = Field(default=5, ge=1, le=64)

    def extras(self) -> dict[str, Any]:
        return {"db_id": self.db_id, "data": self.data, "max_turns": self.max_turns}


# skyrl-gym registry id -> the options a task may give it
SKYRL_ENVS: dict[str, type[NoOptions]] = {
    "gsm8k": NoOptions,
    "gsm8k_multi_turn": MultiTurnOptions,
    "aime": NoOptions,
    "text2sql": SQLOptions,
}


@lru_cache(maxsize=1)
def settings() -> SkyRLSettings:
    return SkyRLSettings()


class SkyRLGymEnvironment:
    """One episode of the skyrl-gym environment ``env_id`` (an id of ``SKYRL_ENVS``)."""

    def __init__(self, env_id: str, config: SkyRLSettings | None = None) -> None:
        if env_id not in SKYRL_ENVS:
            raise ValueError(
                f"skyrl-gym environment {env_id!r} is not offered; offered: {sorted(SKYRL_ENVS)}"
            )
        self.env_id = env_id
        self.config = config or settings()
        self._env: Any = None

    def _env_config(self) -> Any:
        from omegaconf import OmegaConf

        if self.env_id != "text2sql":
            return OmegaConf.create({})
        if not self.config.sql_db_path:
            raise ValueError("text2sql needs LOOM_ENV_SKYRL_SQL_DB_PATH (its database folder)")
        return OmegaConf.create({"db_path": self.config.sql_db_path})

    def reset(self, task: EnvTask) -> EnvReset:
        import skyrl_gym

        options = SKYRL_ENVS[self.env_id].model_validate(task.options)
        if task.label is None:
            raise ValueError(f"skyrl:{self.env_id} needs the task's label (its ground truth)")
        truth = {"method": "rule", "ground_truth": task.label}
        extras = {"reward_spec": truth, "reward_model": truth, "extra_info": {}, **options.extras()}
        self._env = skyrl_gym.make(self.env_id, env_config=self._env_config(), extras=extras)
        prompt = [{"role": "user", "content": task.question}]
        conversation, info = self._env.init(prompt)
        added = [m for m in conversation if m not in prompt]
        return EnvReset(
            observation=render(added) if added else None,
            meta={
                "env": self.env_id,
                "messages": plain_messages(conversation),
                "info": json_safe(info or {}),
            },
        )

    def step(self, action: EnvAction) -> EnvStep:
        if self._env is None:
            raise RuntimeError("step before reset")
        out = self._env.step(action.text)
        done = bool(out["done"])
        meta: dict[str, Any] = {
            "messages": plain_messages(out["observations"]),
            "metadata": json_safe(out.get("metadata") or {}),
        }
        if out.get("postprocessed_action") is not None:
            meta["postprocessed_action"] = str(out["postprocessed_action"])
        if done:
            meta["metrics"] = json_safe(self._env.get_metrics())
        return EnvStep(
            observation=render(out["observations"]), reward=float(out["reward"]), done=done, meta=meta
        )

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None


def offered(config: SkyRLSettings | None = None) -> list[str]:
    """The skyrl-gym ids this deployment offers (text2sql only with its database folder)."""
    config = config or settings()
    return [e for e in SKYRL_ENVS if e != "text2sql" or config.sql_db_path]


def registrations(config: SkyRLSettings | None = None) -> dict[str, Factory]:
    """The registry's ``skyrl:<id>`` names, each a factory of a fresh episode; none where skyrl-gym
    is not installed in this interpreter (its names are then ``unknown_env`` here)."""
    from importlib.util import find_spec

    if find_spec("skyrl_gym") is None:
        return {}
    config = config or settings()

    def factory(env_id: str) -> Factory:
        return lambda: SkyRLGymEnvironment(env_id, config)

    return {PREFIX + e: factory(e) for e in offered(config)}
