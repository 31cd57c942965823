"""Typed client of the rollout service (``POST /v1/rollouts``, ``POST /v1/policy``)."""

from __future__ import annotations

from typing import Any

from loom.clients.base import ServiceClient
from loom.contracts.wire import Group, RolloutRequest


class RolloutClient(ServiceClient):
    """``RolloutClient("http://127.0.0.1:8401").generate(RolloutRequest(prompt="2+2?"))`` -> Group."""

    def generate(self, request: RolloutRequest | dict[str, Any]) -> Group:
        body = request.model_dump(mode="json") if isinstance(request, RolloutRequest) else request
        return Group.model_validate(self.post("/v1/rollouts", json=body))

    def load_policy(
        self, version: int | None = None, *, path: str | None = None, kind: str = "full"
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"version": version, "kind": kind}
        if path is not None:
            body["path"] = path
        return dict(self.post("/v1/policy", json=body))
