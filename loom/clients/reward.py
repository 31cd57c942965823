"""Typed client of the reward service (``reward_svc``), shared by the trainer adapters.

Retries (connection errors, 502/503/504) and timeouts come from ``ServiceClient``. The service URL
defaults to ``LOOM_REWARD_URL``, else the settings' reward port.
"""

from __future__ import annotations

import os
from typing import Any

from loom.clients.base import ServiceClient
from loom.contracts.settings import get_settings
from loom.contracts.wire import Group, RewardResult, RewardSpec

DEFAULT_TIMEOUT_S = 180.0  # OpenRLHF's own remote-reward timeout


def default_url() -> str:
    return os.environ.get("LOOM_REWARD_URL") or get_settings().service_url("reward")


class RewardClient(ServiceClient):
    def __init__(
        self, base_url: str | None = None, *, timeout: float = DEFAULT_TIMEOUT_S, retries: int = 4, **kw: Any
    ) -> None:
        super().__init__(base_url or default_url(), timeout=timeout, retries=retries, **kw)

    def score(self, groups: list[Group], spec: RewardSpec | None = None) -> list[RewardResult]:
        """``POST /v1/rewards``: one RewardResult per group, in order."""
        body = {
            "groups": [g.model_dump(mode="json", exclude_defaults=True) for g in groups],
            "spec": (spec or RewardSpec()).model_dump(mode="json"),
        }
        data = self.post("/v1/rewards", json=body)
        return [RewardResult.model_validate(r) for r in data["results"]]

    def openrlhf(
        self, query: list[str], prompts: list[str] | None = None, labels: list[Any] | None = None
    ) -> dict[str, Any]:
        """``POST /get_reward`` (OpenRLHF protocol); labels of any JSON type (``loom.interop``)."""
        return dict(self.post("/get_reward", json={"query": query, "prompts": prompts, "labels": labels}))

    def slime(self, prompt: str | list[dict[str, Any]], response: str, label: Any = None) -> float:
        """``POST /v1/slime/reward`` (slime protocol): the reward alone, as slime reads it."""
        return float(
            self.post("/v1/slime/reward", json={"prompt": prompt, "response": response, "label": label})
        )

    def slime_components(
        self, prompt: str | list[dict[str, Any]], response: str, label: Any = None
    ) -> dict[str, Any]:
        """``POST /v1/slime/reward/components``: reward, status, detail and every component."""
        body = {"prompt": prompt, "response": response, "label": label}
        return dict(self.post("/v1/slime/reward/components", json=body))
