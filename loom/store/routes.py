"""The policy store's HTTP routes, mounted on the service that holds the store directory (the
learner API). All are internal: ``LOOM_SERVICE_TOKEN`` guards them like the other internal routes.

Read routes (``add_store_routes``), what ``RemotePolicyStore`` (loom/store/remote.py) pulls from; the
same three for a trainer's namespace under ``/v1/store/ns/{namespace}``:

- ``GET /v1/store/latest``: ``{"version": N}`` of the newest version (404 when there is none);
- ``GET /v1/store/v/{version}/manifest``: ``{"policy": PolicyVersion, "files": [{path, size, sha256}]}``
  (the manifest written at publish; a version without one is a 404);
- ``GET /v1/store/v/{version}/files/{path}``: one file the manifest lists, streamed, opened without
  following a link (any other: 404).

Publishing routes (``add_publish_routes``): what the gateway forwards a trainer's uploads to when
the store is on another host (``RemotePolicyWriter``, loom/store/publish.py; docs/interop-rollout.md).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect

from loom.contracts.errors import ErrorBody
from loom.contracts.policies import PolicyRef, RegisterRequest, UploadRequest, UploadTicket, is_namespace
from loom.service_token import UNAUTHORIZED
from loom.store.errors import PublishError
from loom.store.local import PolicyStore
from loom.store.publish import LocalPolicyWriter

log = logging.getLogger("loom.store")


def _store(app: FastAPI, namespace: str | None) -> PolicyStore:
    """The store a read route serves (the learner's, or ``namespace``'s: a 404 for a malformed one)."""
    if namespace is not None and not is_namespace(namespace):
        raise HTTPException(404, {"error": "not_found", "detail": "no such namespace"})
    return PolicyStore(app.state.settings.policy_store_path, create=False, namespace=namespace)


def _manifest_or_404(app: FastAPI, namespace: str | None, version: int) -> dict[str, Any]:
    s = _store(app, namespace)
    found = s.manifest(version) if s.root.is_dir() else None
    if found is None:
        raise HTTPException(404, {"error": "not_found", "detail": f"no policy version {version}"})
    return found


def _latest_of(app: FastAPI, namespace: str | None) -> dict[str, int]:
    s = _store(app, namespace)
    found = s.latest() if s.root.is_dir() else None
    if found is None:
        raise HTTPException(404, {"error": "not_found", "detail": "the policy store holds no version"})
    return {"version": found.version}


def _file_of(app: FastAPI, namespace: str | None, version: int, path: str) -> StreamingResponse:
    listed = {f["path"]: f for f in _manifest_or_404(app, namespace, version)["files"]}
    if path not in listed:  # only what the manifest names: no path is resolved from the request
        raise HTTPException(404, {"error": "not_found", "detail": f"version {version} has no {path}"})
    try:
        with _store(app, namespace).open_file(version, path) as f:
            fd = os.dup(f.fileno())
    except FileNotFoundError:  # a link, or no longer a regular file: never served
        raise HTTPException(
            404, {"error": "not_found", "detail": f"version {version} has no {path}"}
        ) from None
    out = os.fdopen(fd, "rb")
    size = os.fstat(fd).st_size

    def chunks() -> Iterator[bytes]:
        with out:
            while chunk := out.read(1 << 20):
                yield chunk

    return StreamingResponse(
        chunks(), media_type="application/octet-stream", headers={"Content-Length": str(size)}
    )


def add_store_routes(app: FastAPI, guard: Any, base_dir: Path | None = None) -> None:
    """Mount the store routes on ``app``; they serve ``app.state.settings.policy_store_path``: the
    learner's versions under ``/v1/store``, a trainer's under ``/v1/store/ns/{namespace}``, and the
    internal publishing routes the gateway forwards its ``/v1/policies`` uploads to, whose versions
    are checked against the deployment's base model at ``base_dir`` (loom/store/checks.py)."""

    answers: dict[int | str, dict[str, Any]] = {
        **UNAUTHORIZED,
        404: {"model": ErrorBody, "description": "no such version (or file) in the policy store"},
    }

    for prefix, namespace_of, name in (
        ("/v1/store", _learner_namespace, ""),
        ("/v1/store/ns/{namespace}", _trainer_namespace, "ns_"),
    ):
        _add_read_routes(app, guard, answers, prefix, namespace_of, name)

    add_publish_routes(app, guard, base_dir)


def _learner_namespace() -> None:
    """The read routes under ``/v1/store``: the learner's own versions (no namespace)."""
    return None


def _trainer_namespace(namespace: str) -> str:
    """The read routes under ``/v1/store/ns/{namespace}``: a trainer's versions."""
    return namespace


def _add_read_routes(
    app: FastAPI,
    guard: Any,
    answers: dict[int | str, dict[str, Any]],
    prefix: str,
    namespace_of: Callable[..., str | None],
    name: str,
) -> None:
    """The three read routes under ``prefix``, serving the namespace ``namespace_of`` reads (a path
    parameter, or none); ``name`` prefixes the routes' names."""
    get = functools.partial(app.get, tags=["store"], dependencies=[guard])
    file_answers = {**answers, 200: {"content": {"application/octet-stream": {}}}}

    @get(f"{prefix}/latest", responses=answers, name=f"{name}latest")
    def latest(namespace: str | None = Depends(namespace_of)) -> dict[str, int]:
        return _latest_of(app, namespace)

    @get(f"{prefix}/v/{{version}}/manifest", responses=answers, name=f"{name}manifest")
    def manifest(version: int, namespace: str | None = Depends(namespace_of)) -> dict[str, Any]:
        return _manifest_or_404(app, namespace, version)

    @get(
        f"{prefix}/v/{{version}}/files/{{path:path}}",
        responses=file_answers,
        response_class=StreamingResponse,
        name=f"{name}file",
    )
    def file(version: int, path: str, namespace: str | None = Depends(namespace_of)) -> StreamingResponse:
        return _file_of(app, namespace, version, path)


def add_publish_routes(app: FastAPI, guard: Any, base_dir: Path | None = None) -> None:
    """The internal publishing routes (``/v1/store/ns/{namespace}/...``): the gateway, which checked
    the key, its ``policy`` scope and its namespace, forwards a trainer's upload here when the store
    is on another host (``LOOM_POLICY_STORE_URL``)."""
    prefix = "/v1/store/ns/{namespace}"
    answers: dict[int | str, dict[str, Any]] = {
        **UNAUTHORIZED,
        **{s: {"model": ErrorBody} for s in (403, 404, 409, 413, 422)},
    }

    def writer() -> LocalPolicyWriter:
        return LocalPolicyWriter.from_settings(app.state.settings, base_dir=base_dir)

    common: dict[str, Any] = {"tags": ["store"], "dependencies": [guard], "responses": answers}

    @app.post(f"{prefix}/uploads", status_code=201, **common)
    async def declare(namespace: str, body: UploadRequest) -> UploadTicket:
        return await answer(writer().declare(namespace, body))

    @app.put(f"{prefix}/uploads/{{upload_id}}/files/{{path:path}}", **common)
    async def put(
        namespace: str, upload_id: str, path: str, request: Request, offset: int = 0
    ) -> dict[str, int]:
        try:
            return {
                "received": await answer(writer().put(namespace, upload_id, path, offset, request.stream()))
            }
        except ClientDisconnect:  # the sender went away mid-part: the file starts again from 0
            log.info("upload %s: %s cut off at the client's end", upload_id, path)
            return {"received": 0}

    @app.delete(f"{prefix}/uploads/{{upload_id}}", status_code=204, **common)
    async def abort(namespace: str, upload_id: str) -> None:
        await answer(writer().abort(namespace, upload_id))

    @app.post(f"{prefix}/v/{{version}}/delete", status_code=204, **common)
    async def delete(namespace: str, version: int, body: Pins) -> None:
        await answer(writer().delete(namespace, version, set(body.pinned)))

    @app.post(f"{prefix}/uploads/{{upload_id}}/commit", status_code=201, **common)
    async def commit(namespace: str, upload_id: str) -> PolicyRef:
        return await answer(writer().commit(namespace, upload_id))

    @app.post(f"{prefix}/register", status_code=201, **common)
    async def register(namespace: str, body: RegisterRequest) -> PolicyRef:
        return await answer(writer().register(namespace, body))

    @app.get(f"{prefix}/refs", **common)
    async def refs(namespace: str) -> list[PolicyRef]:
        return await answer(writer().refs(namespace))


class Pins(BaseModel):
    """The versions the gateway's state says the namespace's queued and running work names."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, never an empty pin list

    pinned: list[int] = Field(default_factory=list, max_length=100_000)


T = TypeVar("T")


async def answer(work: Awaitable[T]) -> T:
    """``work``'s result, or its ``PublishError`` as the HTTP answer it names."""
    try:
        return await work
    except PublishError as exc:
        raise HTTPException(exc.status, exc.body()) from None
