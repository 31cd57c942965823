"""Every service API turns bad input into 422 with the field path, oversized bodies into 413, never 500.

The apps are imported as ``uvicorn`` would (``<package>.api:app``) and driven in-process; the lifespan
is not started and no request here reaches a handler, so no broker is needed. Routes are discovered
from each app's OpenAPI document, so routes added later are covered without editing this file.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.config import GatewaySettings
from launch import SERVICE_PACKAGES
from loom.contracts.settings import SERVICES, Settings

SCALAR_TYPES = {"integer", "number", "string", "boolean", "array"}
WRONG_VALUE = {"not": ["what", "the", "field", "expects"]}  # an object fits no scalar or list field


ADMIN_KEY = "loom_test-api-errors-admin"


@pytest.fixture(scope="module", params=SERVICES)
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    module = importlib.import_module(f"{SERVICE_PACKAGES[request.param]}.api")
    app: FastAPI = module.app
    headers = {}
    if request.param == "gateway":
        # Every gateway route needs a key: build the same app with one, so requests reach validation.
        key = f"tester:{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}:jobs+runs+admin"
        settings = Settings(api_keys=key, data_dir=tmp_path_factory.mktemp("gateway"))
        app = module.build_app(settings, config=GatewaySettings(run_loop=False))
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    # No `with`: the lifespan (run loops, broker connections) is not started.
    yield TestClient(app, raise_server_exceptions=False, headers=headers)


def _json_body_routes(app: FastAPI) -> list[tuple[str, str, dict[str, Any]]]:
    """(method, concrete path, resolved body schema) of every route that takes a JSON body."""
    spec = app.openapi()
    out = []
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            content = (op.get("requestBody") or {}).get("content", {})
            if "application/json" not in content:
                continue
            schema = _resolve(spec, content["application/json"].get("schema", {}))
            concrete = path
            for param in op.get("parameters", []):
                if param.get("in") == "path":
                    concrete = concrete.replace("{" + param["name"] + "}", "1")
            out.append((method.upper(), concrete, schema))
    return out


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        schema = spec["components"]["schemas"][name]
    return schema


def _scalar_field(spec: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """A top-level property whose every allowed type rejects a JSON object."""
    for name, prop in schema.get("properties", {}).items():
        prop = _resolve(spec, prop)
        options = [_resolve(spec, o) for o in prop.get("anyOf", [prop])]
        types = {o.get("type") for o in options if o.get("type") != "null"}
        if types and types <= SCALAR_TYPES and not any("enum" in o or "const" in o for o in options):
            return str(name)
    return None


def _send(client: TestClient, method: str, path: str, **kwargs: Any) -> Any:
    response = client.request(method, path, **kwargs)
    assert response.status_code != 500, f"{method} {path} -> 500: {response.text[:500]}"
    return response


def _locs(response: Any) -> list[list[Any]]:
    body = response.json()
    assert body["error"] == "validation_error", body
    return [list(e["loc"]) for e in body["detail"]]


def test_every_service_has_a_json_route_to_check(client: TestClient) -> None:
    assert _json_body_routes(client.app), "each service exposes at least POST /v1/ping"  # type: ignore[arg-type]


def test_malformed_json_is_422_at_body(client: TestClient) -> None:
    for method, path, _ in _json_body_routes(client.app):  # type: ignore[arg-type]
        r = _send(
            client, method, path, content=b'{"truncated": ', headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, (path, r.text)
        assert all(loc[0] == "body" for loc in _locs(r)), (path, r.text)


def test_non_object_body_is_422_at_body(client: TestClient) -> None:
    for method, path, _ in _json_body_routes(client.app):  # type: ignore[arg-type]
        r = _send(client, method, path, json=[1, 2, 3])
        assert r.status_code == 422, (path, r.text)
        assert ["body"] in _locs(r) or any(loc[0] == "body" for loc in _locs(r)), (path, r.text)


def test_unknown_field_is_422_naming_it(client: TestClient) -> None:
    checked = 0
    for method, path, schema in _json_body_routes(client.app):  # type: ignore[arg-type]
        r = _send(client, method, path, json={"loom_no_such_field": 1})
        if schema.get("additionalProperties") is not False:
            continue  # protocol adapters (e.g. OpenRLHF's /get_reward) accept their callers' extras
        checked += 1
        assert r.status_code == 422, (path, r.text)
        assert any(loc[0] == "body" and loc[-1] == "loom_no_such_field" for loc in _locs(r)), (path, r.text)
    assert checked >= 1, "Loom's own contracts forbid unknown fields (POST /v1/ping at least)"


def test_wrong_type_is_422_with_the_field_path(client: TestClient) -> None:
    app: FastAPI = client.app  # type: ignore[assignment]
    spec = app.openapi()
    checked = 0
    for method, path, schema in _json_body_routes(app):
        name = _scalar_field(spec, schema)
        if name is None:
            continue
        r = _send(client, method, path, json={name: WRONG_VALUE})
        assert r.status_code == 422, (path, r.text)
        assert any(loc[:2] == ["body", name] for loc in _locs(r)), (path, name, r.text)
        checked += 1
    assert checked >= 1, "no route with a typed scalar field (POST /v1/ping has 'delay')"


def test_out_of_range_ping_names_the_field(client: TestClient) -> None:
    r = _send(client, "POST", "/v1/ping", json={"delay": -1, "timeout": 5})
    assert r.status_code == 422
    assert _locs(r) == [["body", "delay"]]


def _oversized_targets(client: TestClient) -> list[tuple[str, str]]:
    return [(m, p) for m, p, _ in _json_body_routes(client.app)]  # type: ignore[arg-type]


def test_body_at_the_limit_is_read_and_one_byte_more_is_413(client: TestClient) -> None:
    limit = client.app.state.settings.max_body_bytes  # type: ignore[attr-defined]
    invalid = b'{"loom_no_such_field": 1}'
    for method, path in _oversized_targets(client):
        at_limit = invalid + b" " * (limit - len(invalid))
        r = _send(client, method, path, content=at_limit, headers={"content-type": "application/json"})
        assert r.status_code == 422, (path, r.status_code)  # read and validated, not refused
        r = _send(client, method, path, content=at_limit + b" ", headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.status_code)
        assert r.json()["error"] == "payload_too_large"


def test_chunked_body_over_the_limit_is_413(client: TestClient) -> None:
    limit = client.app.state.settings.max_body_bytes  # type: ignore[attr-defined]
    chunk = b" " * 65536

    def body() -> Iterator[bytes]:
        yield b'{"loom_no_such_field": 1}'
        sent = 0
        while sent <= limit:
            yield chunk
            sent += len(chunk)

    for method, path in _oversized_targets(client):
        r = _send(client, method, path, content=body(), headers={"content-type": "application/json"})
        assert "content-length" not in {k.lower() for k in r.request.headers}, "body was not chunked"
        assert r.status_code == 413, (path, r.status_code, r.text[:200])
        assert r.json()["error"] == "payload_too_large"


def test_a_body_that_is_not_utf8_is_422_at_body_naming_the_problem(client: TestClient) -> None:
    for method, path, _ in _json_body_routes(client.app):  # type: ignore[arg-type]
        r = _send(
            client, method, path, content=b'{"x": "\xff\xfe"}', headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, (path, r.status_code, r.text)
        (problem,) = r.json()["detail"]
        assert problem["loc"][0] == "body" and "not valid UTF-8" in problem["msg"], (path, r.text)


def test_a_body_nested_100k_deep_is_422_at_body_naming_the_problem(client: TestClient) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    for method, path, _ in _json_body_routes(client.app):  # type: ignore[arg-type]
        r = _send(client, method, path, content=deep, headers={"content-type": "application/json"})
        assert r.status_code == 422, (path, r.status_code, r.text)
        (problem,) = r.json()["detail"]
        assert problem["loc"][0] == "body" and "nests deeper" in problem["msg"], (path, r.text)


def test_every_error_status_of_every_route_is_documented_with_the_one_error_body(client: TestClient) -> None:
    """Each route's OpenAPI lists the error statuses it can answer, with the ErrorBody schema (the
    same shape as the answers above), and never FastAPI's default HTTPValidationError (whose shape
    Loom's 422 does not have)."""
    spec = client.app.openapi()  # type: ignore[attr-defined]
    assert "HTTPValidationError" not in spec.get("components", {}).get("schemas", {})
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            responses = op["responses"]
            for status in ("413", "422", "500", "503"):
                assert status in responses, (method, path, status)
            for status, resp in responses.items():
                if not status.startswith(("4", "5")) or path == "/readyz" or path == "/v1/ping":
                    continue
                ref = resp["content"]["application/json"]["schema"]["$ref"]
                if path.startswith("/engine/") and ref.endswith("/ErrorResponse"):
                    assert status in ("400", "404", "501"), (method, path, status)
                    continue  # the vLLM-compatible routes answer their own refusals as vLLM does
                assert ref.endswith("/ErrorBody"), (method, path, status, ref)
