"""``/ui``: the run page (docs/run-page.md). Server-rendered HTML over the same state as ``/v1``: the
key's runs and jobs, a run's live curves (server-sent events of its step metrics, per-component reward
means included), its stored samples (RunStore.samples), and a job's scored groups with their
trees and spawn forests.

Authentication is gateway/auth.py's: the login form trades an API key for a session cookie; every other
``/ui`` path needs that session (or the key in a header) and the scope of its kind (runs or jobs).
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape

from gateway.auth import SESSION_COOKIE, SESSION_TTL_S, Refused, WebAuth
from gateway.models import MAX_VERSION
from gateway.quotas import QuotaExceeded
from gateway.ratelimit import retry_after_header
from gateway.routes.deps import TERMINAL, Gateway, GatewayDep, end_event, owned, owner, refused, sse
from gateway.routes.jobs import CountedStream
from gateway.routes.runs import finite_metrics
from gateway.state import GatewayState, JobRow
from gateway.web import STATIC, TEMPLATES
from gateway.web.listing import owned_items
from gateway.web.views import group_view

STREAM_POLL_S = 0.5  # how often a run's event stream looks for new steps
LOGIN_FORM_MAX_BYTES = 4096
LOGIN_COOKIE = "loom_login"  # the login form's token (double-submit), on /ui/login only
LOGIN_TOKEN = re.compile(r"[A-Za-z0-9_-]{43}")  # secrets.token_urlsafe(32)
FORM_TYPE = "application/x-www-form-urlencoded"

router = APIRouter(prefix="/ui", include_in_schema=False)
static = StaticFiles(directory=STATIC)
templates = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=select_autoescape(default=True))


def render(name: str, status: int = 200, **context: Any) -> HTMLResponse:
    html = templates.get_template(name).render(**context)
    return HTMLResponse(
        html,
        status_code=status,
        headers={
            "Cache-Control": "no-store",
            # only this origin's own script and style; no framing, no form posts elsewhere
            "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; "
            "frame-ancestors 'none'; form-action 'self'",
            "X-Content-Type-Options": "nosniff",
        },
    )


def scopes(request: Request) -> frozenset[str]:
    found: frozenset[str] = getattr(request.state, "key_scopes", frozenset())
    return frozenset({"jobs", "runs"}) if "admin" in found else frozenset(found)


# ---------------------------------------------------------------------------------------- session
def login_page(request: Request, status: int = 200, error: str | None = None, wait: float = 0.0) -> Response:
    """The login form with its token (a double-submit: the same random value in the form and in a
    SameSite=Strict cookie only this origin's pages can make the browser send)."""
    token = request.cookies.get(LOGIN_COOKIE, "")
    minted = not LOGIN_TOKEN.fullmatch(token)
    if minted:  # a browser keeps its token: two open forms both stay valid
        token = secrets.token_urlsafe(32)
    response = render("login.html", status=status, error=error, token=token)
    if wait > 0:
        response.headers["Retry-After"] = retry_after_header(wait)
    if minted:
        set_cookie(response, request, LOGIN_COOKIE, token, int(SESSION_TTL_S), "/ui/login")
    return response


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int, path: str) -> None:
    """A cookie no script reads, sent back only by this site's own pages (and only over HTTPS when the
    page came over it)."""
    response.set_cookie(
        name,
        value,
        max_age=max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path=path,
    )


@router.get("/login")
async def login_form(request: Request) -> Response:
    return login_page(request)


@router.post("/login")
async def login(request: Request) -> Response:
    """The key comes in the form body (never a URL); a session cookie goes back. Only from this
    gateway's own form: a foreign Origin/Referer is a 403, a body that is no url-encoded form a 415, a
    missing or wrong form token a 403 (docs/security.md, "The run page's sessions and logins")."""
    web: WebAuth = request.state.web_auth
    if not web.from_own_page(request):
        return login_page(request, 403, "a login from another site's page is refused: use this form")
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != FORM_TYPE:
        return login_page(request, 415, "the login must be this page's form")
    body = await request.body()
    if len(body) > LOGIN_FORM_MAX_BYTES:
        return login_page(request, 413, "form too large")
    form = parse_qs(body.decode("utf-8", "replace"))
    token = (form.get("login_token") or [""])[0]
    cookie = request.cookies.get(LOGIN_COOKIE, "")
    if not cookie or not hmac.compare_digest(token.encode(), cookie.encode()):
        return login_page(request, 403, "the login form expired: log in again")
    key = (form.get("api_key") or [""])[0].strip()
    made = web.login(request, key)
    if isinstance(made, Refused):
        return login_page(request, made.status, made.error, made.wait)
    response = RedirectResponse("/ui/", status_code=303)
    set_cookie(response, request, SESSION_COOKIE, made, int(web.sessions.ttl), "/ui")
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    web: WebAuth = request.state.web_auth
    web.sessions.drop(request.cookies.get(SESSION_COOKIE))
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path="/ui")
    return response


# ------------------------------------------------------------------------------------------ pages
@router.get("/")
async def index(request: Request, gw: GatewayDep) -> HTMLResponse:
    items = await asyncio.to_thread(owned_items, gw.state.path, owner(request))
    allowed = scopes(request)
    return render(
        "index.html",
        key=owner(request),
        runs=items["runs"] if "runs" in allowed else None,
        jobs=items["jobs"] if "jobs" in allowed else None,
        now=time.time(),
    )


@router.get("/runs/{run_id}")
async def run_page(
    run_id: str, request: Request, gw: GatewayDep, step: int | None = Query(None, ge=0, le=MAX_VERSION)
) -> HTMLResponse:
    row = owned(gw.state.runs.get(run_id), request, "run", run_id)
    done = row.completed_steps
    shown = step if step is not None else (done - 1 if done else None)  # default: the last recorded step
    samples = [] if shown is None else await asyncio.to_thread(gw.state.runs.samples, run_id, shown)
    return render(
        "run.html",
        key=owner(request),
        run=row,
        mode=row.config.get("mode", "plain"),
        estimator=row.config.get("estimator", ""),
        step=shown,
        groups=[group_view(p) for p in samples],
    )


JOB_PAGE = 64  # groups on one job page (a 4096-prompt job is read and rendered a page at a time)


def job_html(gw: Gateway, row: JobRow, key: str, offset: int) -> HTMLResponse:
    """One page of a job's groups, read and rendered (called in a thread: a large page must not hold
    the event loop other keys' requests wait on)."""
    n_done, payloads = gw.state.jobs.page(row.id, offset, JOB_PAGE)
    after = offset + len(payloads)
    return render(
        "job.html",
        key=key,
        job=row,
        mode=row.request.get("mode", "plain"),
        counters=row.counters,
        n_done=n_done,
        groups=[group_view(p) for p in payloads],
        next_offset=after if after < n_done else None,
        running=row.status not in TERMINAL,
        refresh=3 if row.status not in TERMINAL else None,  # a running job's page follows it
    )


@router.get("/jobs/{job_id}")
async def job_page(
    job_id: str,
    request: Request,
    gw: GatewayDep,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
) -> HTMLResponse:
    row = owned(await asyncio.to_thread(gw.state.jobs.get, job_id), request, "job", job_id)
    return await asyncio.to_thread(job_html, gw, row, owner(request), offset)


# ---------------------------------------------------------------------------------- run's curves
def step_points(state: GatewayState, run_id: str, after: int) -> list[dict[str, float]]:
    """The run's steps after ``after``: their finite step metrics, as ``/v1/runs/{id}/metrics`` serves
    them (``reward/<component>`` is a component's mean: gateway/stepmetrics.py)."""
    return [finite_metrics(row) for row in state.runs.steps(run_id, after)]


async def run_event_stream(
    state: GatewayState, run_id: str, after: int, request: Request
) -> AsyncIterator[bytes]:
    """``step`` events (id = step) after ``after``, then ``end`` once the run has ended."""
    while True:
        points = await asyncio.to_thread(step_points, state, run_id, after)
        for point in points:
            after = int(point["step"])
            yield sse("step", point, after)
        end = end_event(state.runs.get(run_id))
        if end is not None and not points:
            yield end
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(STREAM_POLL_S)


@router.get("/runs/{run_id}/events")
async def run_events(run_id: str, request: Request, gw: GatewayDep) -> Response:
    """The run's step points as server-sent events (reconnect with ``Last-Event-ID``); the key's
    open streams count against ``LOOM_GATEWAY_QUOTA_STREAMS`` like the jobs' streams."""
    owned(gw.state.runs.get(run_id), request, "run", run_id)
    try:
        after = min(max(int(request.headers.get("last-event-id", "-1")), -1), MAX_VERSION)
    except ValueError:
        after = -1
    release = _take_stream(gw, owner(request))
    if isinstance(release, Response):
        return release
    return CountedStream(
        release,
        run_event_stream(gw.state, run_id, after, request),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


def _take_stream(gw: Gateway, key: str) -> Any:
    """A release function for one more open stream of ``key``, or the 429 when it holds too many."""
    streams, limit = gw.streams, gw.quotas.streams
    if streams.get(key, 0) >= limit:
        return refused(
            QuotaExceeded(
                429,
                "streams",
                limit,
                1,
                streams.get(key, 0),
                f"this key has {limit} event streams open, the most it may (LOOM_GATEWAY_QUOTA_STREAMS)",
            )
        )
    streams[key] = streams.get(key, 0) + 1

    def release() -> None:
        streams[key] -= 1
        if not streams[key]:
            del streams[key]

    return release


@router.get("/runs/{run_id}/steps.json")
async def run_steps_json(
    run_id: str, request: Request, gw: GatewayDep, after: int = Query(-1, ge=-1, le=MAX_VERSION)
) -> list[dict[str, float]]:
    """The same points as the event stream, in one answer."""
    owned(gw.state.runs.get(run_id), request, "run", run_id)
    return await asyncio.to_thread(step_points, gw.state, run_id, after)


def mount(app: Any) -> None:
    """The run page's routes and its static files on ``app`` (gateway/api.py)."""
    app.include_router(router)
    app.mount("/ui/static", static, name="ui-static")
