"""The writers trainers' versions are published through: into the local store, or forwarded to the
store's host over HTTP.

The gateway's ``/v1/policies`` routes (gateway/routes/policies.py) publish through ``policy_writer``:
``LocalPolicyWriter`` when this process holds the store directory, ``RemotePolicyWriter`` with
``LOOM_POLICY_STORE_URL``, which calls the store host's internal publishing routes
(loom/store/routes.py, ``add_publish_routes``) with the service token. Either way a refusal is a
``PublishError`` naming its HTTP answer (docs/interop-rollout.md).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from loom.contracts.policies import PolicyRef, RegisterRequest, UploadRequest, UploadTicket, is_namespace
from loom.contracts.settings import Settings
from loom.service_token import service_headers
from loom.store.checks import Bounds, CheckpointRefused
from loom.store.errors import (
    IntegrityError,
    PublishConflict,
    PublishError,
    PublishForbidden,
    PublishNotFound,
    PublishUnavailable,
    QuotaExceeded,
)
from loom.store.local import PolicyStore
from loom.store.uploads import Uploads


class PublishLimits(BaseSettings):
    """What a publish may hold (``LOOM_GATEWAY_POLICY_*``): read where an upload lands, the gateway
    holding the store or the store's host the gateway forwards it to, so one setting holds for both."""

    model_config = SettingsConfigDict(env_prefix="LOOM_GATEWAY_POLICY_", extra="ignore", frozen=True)

    max_bytes: int = Field(
        default=4 * 1024**3, ge=1, description="largest policy version upload, all its files together"
    )
    register_roots: str = Field(
        default="",
        description="comma-separated directories (a filesystem the replicas share) under which a key with "
        "the 'policy' scope may register a checkpoint (POST /v1/policies/register); empty: off",
    )
    upload_ttl_s: float = Field(
        default=3600.0, gt=0, description="an upload not committed within this many seconds is dropped"
    )
    quota_bytes: int = Field(
        default=64 * 1024**3,
        ge=1,
        description="bytes a key's namespace may hold: its versions' files and its open uploads' "
        "declared files",
    )
    size_factor: float = Field(
        default=4.0,
        ge=1.0,
        description="a version's config may declare at most this many times the deployment base model's "
        "parameters, layers, hidden and intermediate size and positions (loom/store/checks.py)",
    )
    max_params: int = Field(
        default=0, ge=0, description="parameters a version may declare; 0: size_factor x the base model's"
    )


class PolicyWriter(Protocol):
    """Where a gateway's ``/v1/policies`` routes publish (``policy_writer``); errors are
    ``PublishError``s."""

    async def declare(self, namespace: str, req: UploadRequest) -> UploadTicket: ...

    async def put(
        self, namespace: str, upload_id: str, path: str, offset: int, chunks: AsyncIterator[bytes]
    ) -> int: ...

    async def commit(self, namespace: str, upload_id: str) -> PolicyRef: ...

    async def register(self, namespace: str, req: RegisterRequest) -> PolicyRef: ...

    async def refs(self, namespace: str) -> list[PolicyRef]: ...

    async def abort(self, namespace: str, upload_id: str) -> None: ...

    async def delete(self, namespace: str, version: int, pinned: set[int]) -> None: ...


def policy_writer(settings: Settings, base_dir: Path | None = None) -> PolicyWriter:
    """The store this process publishes into: the local one, whose versions are checked against the
    deployment's base model at ``base_dir`` (loom/store/checks.py), or the learner's over HTTP
    (``LOOM_POLICY_STORE_URL``, the service token), which checks them against its own."""
    if settings.policy_store_url:
        return RemotePolicyWriter(settings.policy_store_url, settings.service_token)
    return LocalPolicyWriter.from_settings(settings, base_dir=base_dir)


@functools.lru_cache(maxsize=8)
def bounds_of(base_dir: Path, factor: float, max_params: int) -> Bounds:
    """The bounds of a deployment's base model, read once per process (its config does not change)."""
    return Bounds.of(base_dir, factor, max_params)


def register_roots(limits: PublishLimits) -> list[Path]:
    return [Path(r.strip()) for r in limits.register_roots.split(",") if r.strip()]


class LocalPolicyWriter:
    def __init__(self, uploads: Uploads, roots: list[Path]) -> None:
        self.uploads, self.roots = uploads, roots

    @classmethod
    def from_settings(
        cls, settings: Settings, limits: PublishLimits | None = None, *, base_dir: Path | None = None
    ) -> LocalPolicyWriter:
        """The writer into ``settings``' store under ``limits`` (default: ``LOOM_GATEWAY_POLICY_*``),
        its versions bounded by the base model at ``base_dir`` (None: not checked, the store's own
        unit tests only; every service passes its ``LOOM_MODEL``)."""
        limits = limits or PublishLimits()
        store = PolicyStore(settings.policy_store_path)
        bounds = (
            None
            if base_dir is None
            else functools.partial(bounds_of, base_dir, limits.size_factor, limits.max_params)
        )
        uploads = Uploads(
            store,
            max_bytes=limits.max_bytes,
            ttl_s=limits.upload_ttl_s,
            quota_bytes=limits.quota_bytes,
            bounds=bounds,
            private=(settings.data_dir,),
        )
        return cls(uploads, register_roots(limits))

    async def declare(self, namespace: str, req: UploadRequest) -> UploadTicket:
        return await asyncio.to_thread(self.uploads.declare, namespace, req)

    async def put(
        self, namespace: str, upload_id: str, path: str, offset: int, chunks: AsyncIterator[bytes]
    ) -> int:
        part = await asyncio.to_thread(self.uploads.part, namespace, upload_id, path, offset)
        try:
            async for chunk in chunks:
                part.write(chunk)  # an IntegrityError drops the file
        except BaseException:
            part.abort()  # a broken part: the file starts again from 0
            raise
        return await asyncio.to_thread(part.finish)

    async def commit(self, namespace: str, upload_id: str) -> PolicyRef:
        return await asyncio.to_thread(self.uploads.commit, namespace, upload_id)

    async def register(self, namespace: str, req: RegisterRequest) -> PolicyRef:
        return await asyncio.to_thread(self.uploads.register, namespace, req, self.roots)

    async def refs(self, namespace: str) -> list[PolicyRef]:
        if not is_namespace(namespace):
            return []
        return await asyncio.to_thread(self.uploads.store.namespace(namespace).refs)

    async def abort(self, namespace: str, upload_id: str) -> None:
        await asyncio.to_thread(self.uploads.abort, namespace, upload_id)

    async def delete(self, namespace: str, version: int, pinned: set[int]) -> None:
        await asyncio.to_thread(self.uploads.delete, namespace, version, pinned)


class RemotePolicyWriter:
    """The internal publishing routes of the store's host (``add_publish_routes``)."""

    def __init__(self, url: str, token: str = "", timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.headers = service_headers(token)
        self.timeout = httpx.Timeout(timeout_s, connect=10.0)

    async def _call(self, method: str, route: str, **kw: Any) -> Any:
        url = self.url + route
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                resp = await client.request(method, url, headers=self.headers, **kw)
        except httpx.HTTPError as exc:
            raise PublishUnavailable(f"the policy store did not answer ({type(exc).__name__})") from exc
        if resp.status_code >= 300:
            try:
                body = resp.json()
                detail = body.get("detail", "")
            except ValueError:
                body, detail = {}, ""
            kinds = {403: PublishForbidden, 404: PublishNotFound, 409: PublishConflict}
            if resp.status_code == 422 and body.get("error") == "integrity_error":
                raise IntegrityError(str(detail))
            if resp.status_code == 422 and body.get("error") == "invalid_checkpoint":
                raise CheckpointRefused(str(detail))
            if resp.status_code == 413 and body.get("error") == "quota_exceeded":
                extra = {k: body.get(k) for k in ("quota", "limit", "requested", "in_use")}
                raise QuotaExceeded(str(detail), **extra)
            if resp.status_code in kinds or resp.status_code == 422:
                raise kinds.get(resp.status_code, PublishError)(
                    detail if isinstance(detail, str) else json.dumps(detail)
                )
            raise PublishUnavailable(f"the policy store answered {resp.status_code}")
        return None if resp.status_code == 204 else resp.json()

    async def declare(self, namespace: str, req: UploadRequest) -> UploadTicket:
        body = await self._call("POST", f"/v1/store/ns/{namespace}/uploads", json=req.model_dump(mode="json"))
        return UploadTicket.model_validate(body)

    async def put(
        self, namespace: str, upload_id: str, path: str, offset: int, chunks: AsyncIterator[bytes]
    ) -> int:
        route = f"/v1/store/ns/{namespace}/uploads/{upload_id}/files/{path}?offset={offset}"
        body = await self._call("PUT", route, content=chunks)
        return int(body["received"])

    async def commit(self, namespace: str, upload_id: str) -> PolicyRef:
        return PolicyRef.model_validate(
            await self._call("POST", f"/v1/store/ns/{namespace}/uploads/{upload_id}/commit")
        )

    async def register(self, namespace: str, req: RegisterRequest) -> PolicyRef:
        body = await self._call(
            "POST", f"/v1/store/ns/{namespace}/register", json=req.model_dump(mode="json")
        )
        return PolicyRef.model_validate(body)

    async def refs(self, namespace: str) -> list[PolicyRef]:
        return [
            PolicyRef.model_validate(r) for r in await self._call("GET", f"/v1/store/ns/{namespace}/refs")
        ]

    async def abort(self, namespace: str, upload_id: str) -> None:
        await self._call("DELETE", f"/v1/store/ns/{namespace}/uploads/{upload_id}")

    async def delete(self, namespace: str, version: int, pinned: set[int]) -> None:
        await self._call(
            "POST", f"/v1/store/ns/{namespace}/v/{version}/delete", json={"pinned": sorted(pinned)}
        )
