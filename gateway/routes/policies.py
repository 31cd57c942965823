"""``/v1/policies``: an external trainer publishes its policy versions (docs/interop-rollout.md).

Every route needs the ``policy`` scope (gateway/auth.py). A key publishes into, and sees, only its own
namespace (named after the key): another key's version is a 404 exactly like a missing one. The store
is the local one or, with ``LOOM_POLICY_STORE_URL``, the learner's, which these routes forward to
(``loom.store.policy_writer``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse

from gateway.routes.deps import GatewayDep, owner
from loom.contracts.policies import PolicyRef, RegisterRequest, UploadRequest, UploadTicket
from loom.service import LoomRoute, error_responses
from loom.store import PublishError, PublishNotFound, policy_writer

router = APIRouter(prefix="/policies", tags=["policies"], route_class=LoomRoute)
ANSWERS = error_responses((404, 409, 422, 503))


def refused(exc: PublishError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())


@router.post("/uploads", status_code=201, response_model=UploadTicket, responses=ANSWERS)
async def declare_upload(body: UploadRequest, request: Request, gw: GatewayDep) -> Any:
    """Declare a version's files (path, size, sha256); send each with ``PUT .../files/{path}``, then
    commit. ``version`` None: the namespace's next; a version that exists, or not above the newest,
    is a 409."""
    try:
        return await policy_writer(gw.settings).declare(owner(request), body)
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
        got = await policy_writer(gw.settings).put(owner(request), upload_id, path, offset, request.stream())
    except PublishError as exc:
        return refused(exc)
    return Response(status_code=204, headers={"Upload-Offset": str(got)})


@router.post("/uploads/{upload_id}/commit", status_code=201, response_model=PolicyRef, responses=ANSWERS)
async def commit_upload(upload_id: str, request: Request, gw: GatewayDep) -> Any:
    """Make the version visible, all at once; a 422 unless every declared file arrived intact."""
    try:
        return await policy_writer(gw.settings).commit(owner(request), upload_id)
    except PublishError as exc:
        return refused(exc)


@router.post(
    "/register", status_code=201, response_model=PolicyRef, responses=error_responses((403, 409, 422))
)
async def register_path(body: RegisterRequest, request: Request, gw: GatewayDep) -> Any:
    """A checkpoint folder on a filesystem the replicas share, hashed now; only under the operator's
    ``LOOM_GATEWAY_POLICY_REGISTER_ROOTS`` (none set: 403)."""
    try:
        return await policy_writer(gw.settings).register(owner(request), body)
    except PublishError as exc:
        return refused(exc)


@router.get("", response_model=list[PolicyRef], responses=error_responses((503,)))
async def list_policies(request: Request, gw: GatewayDep) -> Any:
    """This key's versions, oldest first."""
    try:
        return await policy_writer(gw.settings).refs(owner(request))
    except PublishError as exc:
        return refused(exc)


@router.get("/{version}", response_model=PolicyRef, responses=error_responses((404, 503)))
async def get_policy(version: Annotated[int, Path(ge=0, le=2**31)], request: Request, gw: GatewayDep) -> Any:
    """One of this key's versions (another key's: 404, as a missing one)."""
    try:
        for ref in await policy_writer(gw.settings).refs(owner(request)):
            if ref.version == version:
                return ref
        raise PublishNotFound(f"no policy version {version}")
    except PublishError as exc:
        return refused(exc)
