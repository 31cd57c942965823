"""The service token of the internal routes (docs/security-workers.md).

``LOOM_SERVICE_TOKEN`` is a secret the services share; when it is set, the internal routes need
``Authorization: Bearer <token>`` and answer 401 without it: what changes a service's state, shows
its configuration or occupies its workers (every service's ``POST /v1/ping``, the rollout service's
``POST /v1/policy``, ``/engine/reset_prefix_cache`` and ``/engine/server_info``, the learner's
routes). docs/security.md lists every route of every service and who may call it. A service calling
another's internal route sends it (``service_headers``). Empty (the default outside ``loom up``,
which generates one per stack): the routes are open, as before, for a private network.

On the gateway, whose callers present API keys in the same header, a request its own key check has
admitted with the ``admin`` scope (``request.state.key_scopes``) passes instead: there the token's
routes (``/v1/ping``) are the operator's, as ``/v1/queues`` is.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from loom.contracts.errors import ErrorBody

_bearer = HTTPBearer(auto_error=False, description="LOOM_SERVICE_TOKEN (internal routes)")

# the 401 every internal route may answer, for its OpenAPI entry
UNAUTHORIZED: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "LOOM_SERVICE_TOKEN is set and the request lacks it"}
}


class ServiceTokenMissing(Exception):
    pass


def service_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def _require(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(_bearer)
) -> None:
    expected: str = request.app.state.settings.service_token
    if not expected:
        return
    if "admin" in getattr(request.state, "key_scopes", ()):  # the gateway's middleware checked the key
        return
    given = credentials.credentials if credentials is not None else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise ServiceTokenMissing()


def internal_route_guard(app: FastAPI) -> Any:
    """The dependency of ``app``'s internal routes (``dependencies=[guard]``); it reads the token from
    ``app.state.settings`` at each request and answers 401 ``unauthenticated`` without a stack trace."""

    @app.exception_handler(ServiceTokenMissing)
    async def _refuse(request: Request, exc: ServiceTokenMissing) -> JSONResponse:
        return JSONResponse(
            status_code=401,
            content={"error": "unauthenticated", "detail": "this internal route needs the service token"},
            headers={"WWW-Authenticate": "Bearer"},
        )

    return Depends(_require)
