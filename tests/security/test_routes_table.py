"""docs/security.md's route table is every route of every Loom server with the guard the code applies
(issue 35): a route missing from the table, a row naming no route, or a guard that differs fails.

The routes come from the apps themselves (every service's FastAPI app and ``loom engine``'s, built
with and without vLLM's flags). The guards are checked by requests wherever a refusal comes before
any work: with the service token set, a ``service token`` route answers 401 without it (and an
``open`` route of a private service has no token check in its dependencies); on the gateway a
``key:`` route answers 401 (a ``/ui`` page: a redirect to the login form) without a key, 403 to a
key without its scope, and a ``key: any`` route neither to a key of one scope.
"""

from __future__ import annotations

import hashlib
import importlib
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient
from starlette.routing import Mount

from loom import service_token
from loom.contracts.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = ("rollout", "reward", "reflect", "learner")
TOKEN = "routes-table-token"
SCOPES = ("jobs", "runs", "policy")  # a key of each alone ("admin" has every scope)
Route = tuple[str, str, str]  # (service, method, path)


def documented() -> dict[Route, str]:
    """The table of "Who may call each route": (service, method, path) -> who may call."""
    text = (ROOT / "docs" / "security.md").read_text()
    section = text.split("## Who may call each route", 1)[1].split("\n## ", 1)[0]
    table: dict[Route, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("service", "---"):
            continue
        services, methods, paths, who = cells[0].split(", "), cells[1].split(", "), cells[2], cells[3]
        for row in itertools.product(services, methods, re.findall(r"`([^`]+)`", paths)):
            assert row not in table, f"{row} twice in the table"
            table[row] = who
    assert table, "no table under 'Who may call each route'"
    return table


def routes(app: FastAPI) -> dict[tuple[str, str], Any]:
    """(method, path) -> the route, HEAD left out; a mount (static files) as ``GET <prefix>/{path}``."""
    out: dict[tuple[str, str], Any] = {}
    for route in iter_route_contexts(app.routes):
        if isinstance(route.original_route, Mount):
            out["GET", f"{route.path}/{{path}}"] = route
            continue
        for method in route.methods or ():
            if method != "HEAD":
                out[method, str(route.path)] = route
    return out


def needs_token(route: Any) -> bool:
    dependants = [getattr(route, "dependant", None)]
    while dependants:
        dependant = dependants.pop()
        if dependant is None:
            continue
        if dependant.call is service_token._require:
            return True
        dependants.extend(dependant.dependencies)
    return False


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def key_line(name: str, key: str, scopes: str) -> str:
    return f"{name}:{hashlib.sha256(key.encode()).hexdigest()}:{scopes}"


# ------------------------------------------------------------------------------------------------ apps


@pytest.fixture(scope="module")
def apps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, FastAPI]]:
    """Every service's app with the service token set (the module apps as uvicorn imports them)."""
    from learner.api import build_app as learner_app
    from loom.queue import make_celery

    settings = Settings(data_dir=tmp_path_factory.mktemp("routes"), service_token=TOKEN)
    built = {"learner": learner_app(settings, celery_app=make_celery("learner", settings))}
    saved = {}
    for service in ("rollout", "reward", "reflect", "sandbox"):
        app = importlib.import_module(f"{service}_svc.api").app
        saved[service] = app.state.settings
        app.state.settings = settings
        built[service] = app
    try:
        yield built
    finally:
        for service, value in saved.items():
            built[service].state.settings = value


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    from gateway.api import build_app
    from gateway.config import GatewaySettings

    keys = ",".join(key_line(s, f"loom_routes-{s}", s) for s in SCOPES)
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("gateway"),
        api_keys=keys,
        service_token=TOKEN,
    )
    return build_app(settings, config=GatewaySettings(run_loop=False, burst=100_000, auth_fail_burst=100_000))


def engine_app(monkeypatch: pytest.MonkeyPatch, dev: bool, lora: bool) -> FastAPI:
    from rollout_svc.engines.server import create_engine_app
    from rollout_svc.engines.simulated import SimulatedEngine

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1" if dev else "0")
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True" if lora else "False")
    return create_engine_app(SimulatedEngine(1.0), "sim")


def in_code(apps: dict[str, FastAPI], gateway: FastAPI, monkeypatch: pytest.MonkeyPatch) -> dict[Route, str]:
    """Every (service, method, path) served, with ``loom engine``'s gates: "dev mode", "LoRA
    updating" or "" (always)."""
    out: dict[Route, str] = {}
    for service, app in {**apps, "gateway": gateway}.items():
        out.update({(service, m, p): "" for m, p in routes(app)})
    plain = routes(engine_app(monkeypatch, dev=False, lora=False))
    dev = routes(engine_app(monkeypatch, dev=True, lora=False))
    lora = routes(engine_app(monkeypatch, dev=False, lora=True))
    for m, p in plain | dev | lora:
        out["engine", m, p] = "" if (m, p) in plain else ("dev mode" if (m, p) in dev else "LoRA updating")
    return out


# ------------------------------------------------------------------------------------------------ tests


def test_every_route_is_in_the_table_and_every_row_is_a_route(
    apps: dict[str, FastAPI], gateway: FastAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    table, code = documented(), in_code(apps, gateway, monkeypatch)
    assert sorted(set(code) - set(table)) == [], "routes missing from docs/security.md's table"
    assert sorted(set(table) - set(code)) == [], "rows of docs/security.md's table that are no route"
    for route, gate in code.items():
        if route[0] == "engine":
            assert table[route] == (f"open ({gate})" if gate else "open"), route


def test_the_private_services_guards_are_the_tables(apps: dict[str, FastAPI]) -> None:
    table = documented()
    checked = 0
    for service, app in apps.items():
        client = TestClient(app, raise_server_exceptions=False)
        for (method, path), route in routes(app).items():
            who = table[service, method, path]
            assert who in ("open", "service token"), (service, path, who)
            assert needs_token(route) == (who == "service token"), (service, method, path, who)
            if who == "service token":
                r = client.request(method, concrete(path), headers={"Authorization": "Bearer wrong"})
                assert r.status_code == 401 and r.json()["error"] == "unauthenticated", (path, r.text)
                checked += 1
    assert checked >= 4  # at least every private service's ping


def _refused_without_key(r: Any) -> bool:
    if r.status_code == 303:
        return r.headers["location"].startswith("/ui/login")
    return r.status_code == 401 and r.json()["error"] == "unauthenticated"


def test_the_gateways_guards_are_the_tables(gateway: FastAPI) -> None:
    from gateway.auth import OPEN_PATHS, UI_OPEN_PATHS, UI_STATIC

    table = documented()
    client = TestClient(gateway, raise_server_exceptions=False, follow_redirects=False)
    for (method, path), _ in routes(gateway).items():
        who = table["gateway", method, path]
        url = concrete(path)
        if who == "open":
            assert path in OPEN_PATHS | UI_OPEN_PATHS or path.startswith(UI_STATIC), (method, path)
            continue
        assert who.startswith("key: "), (path, who)
        scope = who.removeprefix("key: ")
        r = client.request(method, url)
        assert _refused_without_key(r), (method, path, r.status_code, r.text[:200])
        for other in SCOPES:
            r = client.request(method, url, headers={"Authorization": f"Bearer loom_routes-{other}"})
            refused = r.status_code == 403 and r.json()["error"] == "forbidden"
            assert refused == (scope not in ("any", other)), (
                method,
                path,
                other,
                r.status_code,
                r.text[:200],
            )
