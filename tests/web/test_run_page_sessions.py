"""The run page's sessions and logins under hostile users (issue 35, findings 1 and 6; docs/security.md,
"The run page's sessions and logins"): a key's login flood neither logs another key out nor grows its
own sessions past ``LOOM_GATEWAY_SESSIONS_PER_KEY``, and is answered 429 past the per-key and
per-address login limits; a login posted from another site's page (login CSRF) makes no session.

In-process gateway apps on a real embedded broker in tmp_path; each "browser" is its own TestClient (its
own cookie jar and client address) over one app. The last test drives Debian's chromium against the
gateway under uvicorn, with the attacker's page on another origin."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parents[1] / "gateway"))
from helpers import ADMIN_KEY, API_KEYS, JOBS_KEY, RUNS_KEY, free_port  # noqa: E402

from gateway.api import build_app  # noqa: E402
from gateway.auth import Sessions  # noqa: E402
from gateway.config import GatewaySettings  # noqa: E402
from gateway.keys import KeyRing  # noqa: E402
from loom.contracts.settings import Settings  # noqa: E402
from loom.queue import make_celery  # noqa: E402

FORM = "application/x-www-form-urlencoded"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
]
SLOW_LOGINS = 0.001  # logins/s: no token comes back while a test runs


def make_app(tmp_path: Path, **config: Any) -> FastAPI:
    """A gateway on ``tmp_path``; ``config``: its GatewaySettings besides run_loop=False."""
    settings = Settings(
        data_dir=tmp_path, broker_url="embedded", result_backend="embedded", api_keys=API_KEYS
    )
    gateway = GatewaySettings(run_loop=False, **config)
    return build_app(settings, celery_app=make_celery("gateway", settings), config=gateway)


@pytest.fixture
def app(tmp_path: Path) -> Iterator[FastAPI]:
    app = make_app(tmp_path, login_rate=SLOW_LOGINS)  # the other login settings: their defaults
    with TestClient(app):  # the lifespan runs once; browsers below are more clients of it
        yield app


def browser(app: FastAPI, address: str = "10.0.0.1") -> TestClient:
    """A browser at ``address``: its own cookie jar."""
    return TestClient(app, client=(address, 50000))


def form_token(client: TestClient) -> str:
    form = client.get("/ui/login")
    found = re.search(r'name="login_token" value="([^"]+)"', form.text)
    assert form.status_code == 200 and found is not None
    return found[1]


def post_login(
    client: TestClient, key: str, token: str | None, headers: dict[str, str] | None = None
) -> httpx.Response:
    body = f"api_key={key}" if token is None else f"login_token={token}&api_key={key}"
    return client.post(
        "/ui/login",
        content=body,
        headers={"Content-Type": FORM, **(headers or {})},
        follow_redirects=False,
    )


def login(client: TestClient, key: str) -> str:
    """The session id of a login through the form (as a browser does)."""
    r = post_login(client, key, form_token(client))
    assert r.status_code == 303, r.text
    return r.cookies["loom_session"]


def logged_in(client: TestClient, sid: str) -> bool:
    """Whether ``sid`` still opens the run page (else the page redirects to the login form)."""
    r = client.get("/ui/", headers={"Cookie": f"loom_session={sid}"}, follow_redirects=False)
    assert r.status_code in (200, 303), r.text
    return r.status_code == 200


# ------------------------------------------------------------------------ finding 1: login floods
def test_a_keys_sessions_are_bounded_and_never_evict_another_keys() -> None:
    trainer, runner, _ = KeyRing.from_spec(API_KEYS).keys
    sessions = Sessions(per_key=32)
    theirs = sessions.create(runner)
    mine = [sessions.create(trainer) for _ in range(2_050)]  # the probe's flood, past the old 10,000 cap
    assert sessions.get(theirs) == runner
    assert sessions.count(trainer.name) == 32 and sessions.count(runner.name) == 1
    assert all(sessions.get(sid) == trainer for sid in mine[-32:])
    assert all(sessions.get(sid) is None for sid in mine[:-32])  # its own oldest went
    sessions.drop(theirs)
    assert sessions.get(theirs) is None and sessions.count(runner.name) == 0


@pytest.mark.slow
@pytest.mark.timeout(900)  # 2,050 requests in-process: ~10 s on a loaded 2-core machine
def test_a_login_flood_is_429_past_the_address_limit_and_logs_no_one_else_out(app: FastAPI) -> None:
    """The probe: 2,050 logins with one valid key from one address (the default burst and sessions
    per key; a rate slow enough that no token comes back while the flood runs)."""
    theirs = login(browser(app, "10.0.0.2"), RUNS_KEY)
    flooder = browser(app, "10.0.0.1")
    token = form_token(flooder)
    statuses: dict[int, int] = {}
    for _ in range(2_050):
        r = post_login(flooder, JOBS_KEY, token)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code == 429:
            assert int(r.headers["Retry-After"]) >= 1 and "loom_session" not in r.cookies
    burst = GatewaySettings().login_burst
    assert statuses == {303: burst, 429: 2_050 - burst}
    assert logged_in(browser(app, "10.0.0.2"), theirs)


def test_one_key_is_limited_across_addresses_and_holds_at_most_its_sessions(tmp_path: Path) -> None:
    app = make_app(tmp_path, sessions_per_key=3, login_burst=5, login_rate=SLOW_LOGINS)
    with TestClient(app):
        theirs = login(browser(app, "10.0.1.1"), RUNS_KEY)
        # one key from 8 addresses (each address's own bucket is full): the key's own limit answers
        made, refused = [], []
        for i in range(8):
            client = browser(app, f"10.0.2.{i}")
            r = post_login(client, JOBS_KEY, form_token(client))
            (made if r.status_code == 303 else refused).append(r)
        assert len(made) == 5 and [r.status_code for r in refused] == [429] * 3
        assert all("too many logins with this key" in r.text and r.headers["Retry-After"] for r in refused)
        sids = [r.cookies["loom_session"] for r in made]
        page = browser(app, "10.0.3.1")
        assert [logged_in(page, sid) for sid in sids] == [False, False, True, True, True]
        assert logged_in(page, theirs)


def test_one_address_is_limited_across_keys(tmp_path: Path) -> None:
    app = make_app(tmp_path, login_burst=2, login_rate=SLOW_LOGINS)
    with TestClient(app):
        shared = browser(app, "10.0.4.1")
        token = form_token(shared)
        assert [post_login(shared, key, token).status_code for key in (RUNS_KEY, JOBS_KEY)] == [303, 303]
        r = post_login(shared, ADMIN_KEY, token)  # a fresh key, but this address has logged in enough
        assert r.status_code == 429 and "too many logins from this address" in r.text
        assert r.headers["Retry-After"] and "loom_session" not in r.cookies
        # wrong keys pay the address's login bucket too: guessing is no way around it
        assert post_login(shared, "loom_not_a_key", token).status_code == 429
        login(browser(app, "10.0.4.2"), ADMIN_KEY)  # another address is not affected


def test_a_new_login_replaces_the_browsers_own_session(app: FastAPI) -> None:
    client = browser(app)
    first = login(client, RUNS_KEY)
    second = login(client, RUNS_KEY)  # the jar sends the first session's cookie with this login
    assert first != second
    assert not logged_in(client, first) and logged_in(client, second)


# ------------------------------------------------------------------------- finding 6: login CSRF
def test_a_login_posted_from_another_origin_makes_no_session(app: FastAPI) -> None:
    victim = browser(app)
    # the probe: another site's form, enctype text/plain, carrying the attacker's key
    r = victim.post(
        "/ui/login",
        content=f"api_key={RUNS_KEY}\r\n",
        headers={"Origin": "https://evil.example", "Content-Type": "text/plain"},
        follow_redirects=False,
    )
    assert r.status_code == 403 and "loom_session" not in r.cookies
    # the same post with a foreign Referer and no Origin (an older browser), or a sandboxed frame's
    for headers in ({"Referer": "https://evil.example/page"}, {"Origin": "null"}):
        r = victim.post(
            "/ui/login",
            content=f"api_key={RUNS_KEY}\r\n",
            headers={**headers, "Content-Type": "text/plain"},
            follow_redirects=False,
        )
        assert r.status_code == 403 and "loom_session" not in r.cookies, headers
    # refused on Origin alone: even a well-formed form with the victim's own token
    token = form_token(victim)
    r = post_login(victim, RUNS_KEY, token, {"Origin": "https://evil.example"})
    assert r.status_code == 403 and "loom_session" not in r.cookies
    assert victim.get("/ui/", follow_redirects=False).headers["location"] == "/ui/login"


def test_a_login_needs_this_origin_and_the_forms_token(app: FastAPI) -> None:
    client = browser(app)
    token = form_token(client)
    # a same-origin post from the form: by Origin, or by Referer where a browser sends no Origin
    for headers in ({"Origin": "http://testserver"}, {"Referer": "http://testserver/ui/login"}):
        assert post_login(client, RUNS_KEY, token, headers).status_code == 303, headers
    # neither header (no browser): the form's token is still needed, fetched with the form
    assert post_login(client, RUNS_KEY, token).status_code == 303
    blind = browser(app, "10.0.5.1")
    r = post_login(blind, RUNS_KEY, None)
    assert r.status_code == 403 and "loom_session" not in r.cookies
    r = post_login(blind, RUNS_KEY, "A" * 43)  # a made-up token: not the one its form cookie holds
    assert r.status_code == 403 and "loom_session" not in r.cookies
    assert post_login(blind, RUNS_KEY, form_token(blind)).status_code == 303  # the form, then the post
    # the right token in another body type is no form post
    r = client.post(
        "/ui/login",
        content=f"login_token={token}&api_key={RUNS_KEY}",
        headers={"Content-Type": "text/plain", "Origin": "http://testserver"},
        follow_redirects=False,
    )
    assert r.status_code == 415 and "loom_session" not in r.cookies


def test_a_proxys_public_origin_is_allowed_when_configured(tmp_path: Path) -> None:
    """Behind a proxy that rewrites Host, the browser's Origin is the proxy's: LOOM_GATEWAY_UI_ORIGINS."""
    public = {"Origin": "https://loom.example"}
    with TestClient(make_app(tmp_path / "a")) as client:
        assert post_login(client, RUNS_KEY, form_token(client), public).status_code == 403
    with TestClient(make_app(tmp_path / "b", ui_origins="https://loom.example/")) as client:
        assert post_login(client, RUNS_KEY, form_token(client), public).status_code == 303
        assert (
            post_login(client, RUNS_KEY, form_token(client), {"Origin": "http://loom.example"}).status_code
            == 403
        )


# ------------------------------------------------------------------------------ a real browser
EVIL_PAGE = """<!doctype html><html><body>
<form id="f" method="post" action="{action}" enctype="text/plain">
<input type="hidden" name="api_key" value="{key}"></form>
<script>document.getElementById("f").submit();</script>
</body></html>"""


@pytest.fixture
def gateway_url(tmp_path: Path) -> Iterator[str]:
    import uvicorn

    app = make_app(tmp_path)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def evil_url(gateway_url: str) -> Iterator[str]:
    """Another origin (another host name and port) whose page posts the attacker's key to the login."""
    page = EVIL_PAGE.format(action=gateway_url + "/ui/login", key=RUNS_KEY).encode()

    class Evil(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Evil)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}/"
    finally:
        server.shutdown()
        thread.join(30)


def test_in_a_browser_another_sites_login_form_makes_no_session_and_the_own_form_does(
    gateway_url: str, evil_url: str
) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (deploy/setup.sh installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = chromium.new_page()
            with page.expect_response(
                lambda r: r.url == gateway_url + "/ui/login", timeout=120_000
            ) as answer:
                page.goto(evil_url)
            assert answer.value.status == 403  # the attacker's post reached the gateway and was refused
            assert not [c for c in page.context.cookies() if c["name"] == "loom_session"]
            page.goto(gateway_url + "/ui/")
            assert page.url.endswith("/ui/login")  # not logged in under the attacker's key
            # the gateway's own form still logs in (Origin: this host; the form's token)
            page.fill("#api_key", RUNS_KEY)
            page.click("#login")
            page.wait_for_url("**/ui/", timeout=120_000)
            assert [c for c in page.context.cookies() if c["name"] == "loom_session"]
        finally:
            chromium.close()
