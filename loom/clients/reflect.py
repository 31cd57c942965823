"""Typed client of the reflect service (``POST /v1/reflect``)."""

from __future__ import annotations

import os
from typing import Any

from loom.clients.base import ServiceClient
from loom.contracts.settings import get_settings
from loom.contracts.wire import Group, ReflectParams, ReflectResult


def default_url() -> str:
    return os.environ.get("LOOM_REFLECT_URL") or get_settings().service_url("reflect")


class ReflectClient(ServiceClient):
    """``ReflectClient().revise(group, ReflectParams(detector="gold"))`` -> ReflectResult."""

    def __init__(self, base_url: str | None = None, *, timeout: float = 600.0, **kw: Any) -> None:
        super().__init__(base_url or default_url(), timeout=timeout, **kw)

    def revise(self, group: Group, params: ReflectParams | None = None) -> ReflectResult:
        body = {
            "group": group.model_dump(mode="json", exclude_defaults=True),
            "params": (params or ReflectParams()).model_dump(mode="json"),
        }
        return ReflectResult.model_validate(self.post("/v1/reflect", json=body))
