"""``/v1/policies``: an external trainer publishes its policy versions (docs/interop-rollout.md).

Every route needs the ``policy`` scope (gateway/auth.py). A key publishes into, and sees, only its own
namespace (named after the key): another key's version is a 404 exactly like a missing one. The store
is the local one or, with ``LOOM_POLICY_STORE_URL``, the learner's, which these routes forward to
(``loom.store.policy_writer``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from gateway.routes.deps import Gateway, GatewayDep, owner
from loom.contracts.policies import PolicyRef, RegisterRequest, UploadRequest, UploadTicket
from loom.service import LoomRoute, error_responses
from loom.store import PolicyWriter, PublishError, PublishNotFound
from loom.store import policy_writer as store_writer
from zoo.registry import resolve_model_path

router = APIRouter(prefix="/policies", tags=["policies"], route_class=LoomRoute)
ANSWERS = error_responses((404, 409, 413, 422, 503))
log = logging.getLogger("loom.gateway.policies")


def policy_writer(gw: Gateway) -> PolicyWriter:
    """The store this gateway publishes into, its versions checked against the deployment's base model
    (``LOOM_MODEL``; loom/store/checks.py)."""
    return store_writer(gw.settings, resolve_model_path(gw.settings.model))


def refused(exc: PublishError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())


def pinned(gw: Gateway, key: str) -> set[int]:
    """The versions of ``key``'s namespace that its queued and running jobs and runs name."""
    out: set[int] = set()
    for table, column in (("jobs", "request"), ("runs", "config")):
        rows = gw.state.db.all(
            f"SELECT {column} FROM {table} WHERE owner=? AND status IN ('queued', 'running')",  # noqa: S608
            (key,),
        )
        for row in rows:
            body = json.loads(row[column])
            if body.get("policy_namespace") != key:
                continue
            for field in ("policy_version", "initial_policy_version"):
                if isinstance(body.get(field), int):
                    out.add(body[field])
    return out


@router.post("/uploads", status_code=201, response_model=UploadTicket, responses=ANSWERS)
async def declare_upload(body: UploadRequest, request: Request, gw: GatewayDep) -> Any:
    """Declare a version's files (path, size, sha256); send each with ``PUT .../files/{path}``, then
    commit. ``version`` None: the namespace's next; a version that exists, or not above the newest,
    is a 409."""
    try:
        return await policy_writer(gw).declare(owner(request), body)
    except PublishError as exc:
        return refused(exc)


@router.put("/uploads/{upload_id}/files/{path:path}", status_code=204, responses=ANSWERS)
async def put_file(
    upload_id: str,
    path: str,
    request: Request,
    gw: GatewayDep,
    offset: Annotated[int, Query(ge=0, description="bytes of this file already sent (parts)")] = 0,
) -> Response:
    """The file's bytes (raw body, streamed to disk), whole or as parts appended at ``offset``. When
    the declared size is reached the sha256 is checked: a mismatch, or a byte past the size, is a 422
    ``integrity_error`` naming the file, which is dropped (send it again from offset 0)."""
    try:
        got = await policy_writer(gw).put(owner(request), upload_id, path, offset, request.stream())
    except PublishError as exc:
        return refused(exc)
    except ClientDisconnect:  # a part cut off by its sender: dropped, nobody left to answer
        log.info("upload %s: %s cut off at the client's end; the file starts again from 0", upload_id, path)
        return Response(status_code=400)
    return Response(status_code=204, headers={"Upload-Offset": str(got)})


@router.delete("/uploads/{upload_id}", status_code=204, responses=error_responses((404, 503)))
async def abort_upload(upload_id: str, request: Request, gw: GatewayDep) -> Response:
    """Drop an open upload and its files: its slot among the namespace's 4 open uploads is free."""
    try:
        await policy_writer(gw).abort(owner(request), upload_id)
    except PublishError as exc:
        return refused(exc)
    return Response(status_code=204)


@router.post("/uploads/{upload_id}/commit", status_code=201, response_model=PolicyRef, responses=ANSWERS)
async def commit_upload(upload_id: str, request: Request, gw: GatewayDep) -> Any:
    """Make the version visible, all at once; a 422 unless every declared file arrived intact."""
    try:
        return await policy_writer(gw).commit(owner(request), upload_id)
    except PublishError as exc:
        return refused(exc)


@router.post(
    "/register", status_code=201, response_model=PolicyRef, responses=error_responses((403, 409, 413, 422))
)
async def register_path(body: RegisterRequest, request: Request, gw: GatewayDep) -> Any:
    """A checkpoint folder on a filesystem the replicas share, hashed now; only under the operator's
    ``LOOM_GATEWAY_POLICY_REGISTER_ROOTS`` (none set: 403)."""
    try:
        return await policy_writer(gw).register(owner(request), body)
    except PublishError as exc:
        return refused(exc)


@router.get("", response_model=list[PolicyRef], responses=error_responses((503,)))
async def list_policies(request: Request, gw: GatewayDep) -> Any:
    """This key's versions, oldest first."""
    try:
        return await policy_writer(gw).refs(owner(request))
    except PublishError as exc:
        return refused(exc)


@router.delete("/{version}", status_code=204, responses=error_responses((404, 409, 503)))
async def delete_policy(
    version: Annotated[int, Path(ge=1, le=2**31)], request: Request, gw: GatewayDep
) -> Response:
    """Delete one of this key's versions, freeing its bytes of the key's quota; a 409 while a queued
    or running job or run of the key names it. Its number is never given again."""
    key = owner(request)
    try:
        await policy_writer(gw).delete(key, version, await asyncio.to_thread(pinned, gw, key))
    except PublishError as exc:
        return refused(exc)
    return Response(status_code=204)


@router.get("/{version}", response_model=PolicyRef, responses=error_responses((404, 503)))
async def get_policy(version: Annotated[int, Path(ge=0, le=2**31)], request: Request, gw: GatewayDep) -> Any:
    """One of this key's versions (another key's: 404, as a missing one)."""
    try:
        for ref in await policy_writer(gw).refs(owner(request)):
            if ref.version == version:
                return ref
        raise PublishNotFound(f"no policy version {version}")
    except PublishError as exc:
        return refused(exc)
