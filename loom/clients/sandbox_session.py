"""Typed client of the sandbox's interpreter sessions: the sandbox as a tool for a trajectory.

A multi-turn rollout opens one session per trajectory and runs the policy's code cells in it; the
interpreter keeps its variables between cells (docs/sandbox.md "The sandbox as a tool"). Calls never
raise for what the sandbox or the network does: a session the sandbox could not open, a 429 that
outlasts ``busy_wait_s``, an unreachable service or an unknown id is that call's ``sandbox_error``
or ``session_lost`` outcome, so a tool failure is an observation the policy sees, not a crashed
rollout. Sessions live in the sandbox process that opened them: behind several sandbox replicas,
route a session's calls to one (its id is in the path).

    with SandboxSessionClient(url) as client, client.session() as tool:
        tool.run("x = 6 * 7")
        tool.run("x").stdout  # "42\\n"
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from loom.clients.base import LoomHTTPError, ServiceClient
from loom.clients.sandbox import default_url
from loom.closing import Closing
from loom.contracts.sandbox import CallResult, Limits, SessionCall, SessionInfo, SessionLimits, SessionOpen


class SandboxSessionClient(ServiceClient):
    def __init__(
        self,
        base_url: str | None = None,
        *,
        timeout: float = 300.0,
        retries: int = 2,
        busy_wait_s: float = 60.0,
        **kw: Any,
    ) -> None:
        super().__init__(base_url or default_url(), timeout=timeout, retries=retries, **kw)
        self.busy_wait_s = busy_wait_s

    def open(self, limits: Limits | None = None, session: SessionLimits | None = None) -> SessionInfo:
        """A new session, waiting out a full sandbox (429) up to ``busy_wait_s``; a session that
        could not be opened is answered ended (``alive`` false, ``ended`` ``sandbox_error``)."""
        body = SessionOpen(limits=limits or Limits(), session=session or SessionLimits())
        give_up = time.monotonic() + self.busy_wait_s
        while True:
            try:
                return SessionInfo.model_validate(
                    self.post("/v1/sessions", json=body.model_dump(mode="json"))
                )
            except LoomHTTPError as exc:
                if exc.status == 429 and time.monotonic() < give_up:
                    time.sleep(0.2)
                    continue
            except httpx.HTTPError:
                pass
            return SessionInfo(
                id="", alive=False, ended="sandbox_error", limits=body.limits, session=body.session
            )

    def run(self, info: SessionInfo, code: str) -> CallResult:
        """One cell in the session; never raises (see the module's docstring)."""
        if not info.id:
            return CallResult(status="sandbox_error", detail="the session was never opened", session=info)
        try:
            data = self.post(
                f"/v1/sessions/{info.id}/run", json=SessionCall(code=code).model_dump(mode="json")
            )
            return CallResult.model_validate(data)
        except LoomHTTPError as exc:
            status = "session_lost" if exc.status == 404 else "sandbox_error"
            why = f"sandbox answered {exc.status}: {str(exc)[:200]}"
        except httpx.HTTPError as exc:
            status, why = "sandbox_error", f"sandbox unreachable: {type(exc).__name__}: {str(exc)[:200]}"
        lost = info.model_copy(update={"alive": False}) if status == "session_lost" else info
        return CallResult(status=status, detail=why, session=lost)  # type: ignore[arg-type]

    def end(self, info: SessionInfo) -> SessionInfo | None:
        """Close the session (None when the sandbox could not be told: its idle TTL reaps it)."""
        if not info.id:
            return None
        try:
            return SessionInfo.model_validate(self.request("DELETE", f"/v1/sessions/{info.id}"))
        except (LoomHTTPError, httpx.HTTPError):
            return None

    def session(self, limits: Limits | None = None, session: SessionLimits | None = None) -> ToolSession:
        """``with client.session() as tool: tool.run(code)``: opened now, closed at the end."""
        return ToolSession(self, self.open(limits, session))


class ToolSession(Closing):
    """One open session bound to its client: ``run`` cells, ``close`` (or leave the ``with``)."""

    def __init__(self, client: SandboxSessionClient, info: SessionInfo) -> None:
        self.client, self.info = client, info

    def run(self, code: str) -> CallResult:
        result = self.client.run(self.info, code)
        self.info = result.session if result.session.id else self.info
        return result

    def close(self) -> None:
        self.client.end(self.info)
