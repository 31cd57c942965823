"""The control-plane requests and vLLM 0.32's answers to them, as measured on a real vLLM server.

One table, two users: tests/rollout/test_control.py holds ``loom engine`` to it, and
tests/vllm_server/test_protocol.py holds the real vLLM server to it, so the imitation cannot drift from
what vLLM does (status, JSON or plain text, the fields a client reads). ``{served}`` stands for the
served model's name. The cases run in order on one server and leave it as they found it (resumed,
weight version ``default``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import httpx

NO_BODY = object()


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    status: int
    reply: Literal["json", "text", "empty"]
    expect: Any = None  # json: {dotted key: value} that must match; text: the exact body
    body: Any = NO_BODY  # a JSON body
    raw: str | None = None  # or raw bytes sent as application/json (malformed JSON)
    content_type: str = "application/json"

    @property
    def id(self) -> str:
        sent = self.raw if self.raw is not None else ("" if self.body is NO_BODY else repr(self.body))
        return f"{self.method} {self.path} {sent}"[:90]


def _bad(param: str | None, message: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"error.type": "Bad Request", "error.code": 400, "error.param": param}
    if message is not None:
        out["error.message"] = message
    return out


MISSING_ADAPTER = "no-such-adapter"

CASES: list[Case] = [
    Case("GET", "/health", 200, "empty"),
    Case("GET", "/version", 200, "json", {"version": "0.32.0"}),
    Case(
        "GET", "/v1/models", 200, "json", {"object": "list", "data.0.id": "{served}", "data.0.parent": None}
    ),
    Case("GET", "/is_paused", 200, "json", {"is_paused": False}),
    Case("GET", "/weight_info", 200, "json", {"weight_version": "default"}),
    Case(
        "POST",
        "/update_weight_version",
        200,
        "json",
        {"success": True, "new_version": "v1"},
        {"new_version": "v1"},
    ),
    Case("GET", "/weight_info", 200, "json", {"weight_version": "v1"}),
    Case("POST", "/update_weight_version", 400, "json", _bad("body.new_version"), {}),
    Case("POST", "/update_weight_version", 400, "json", _bad("body.new_version"), {"new_version": 3}),
    Case("POST", "/update_weight_version", 400, "json", _bad("body.0"), raw="notjson"),
    Case(
        "POST",
        "/update_weight_version",
        200,
        "json",
        {"success": True, "new_version": "default"},
        {"new_version": "default"},
    ),  # fmt: skip
    Case("POST", "/reset_prefix_cache", 200, "json", {"success": True}),
    Case("POST", "/pause", 200, "json", {"status": "paused"}),
    Case("GET", "/is_paused", 200, "json", {"is_paused": True}),
    Case("POST", "/pause?mode=wait", 200, "json", {"status": "paused"}),
    Case("POST", "/pause?mode=bogus", 400, "json", _bad("query.mode")),
    Case("POST", "/pause?clear_cache=maybe", 400, "json", _bad("query.clear_cache")),
    Case("POST", "/resume", 200, "json", {"status": "resumed"}),
    Case("POST", "/resume", 200, "json", {"status": "resumed"}),
    Case("POST", "/pause?mode=keep", 200, "json", {"status": "paused"}),
    Case("POST", "/resume", 200, "json", {"status": "resumed"}),
    Case("GET", "/is_paused", 200, "json", {"is_paused": False}),
    Case("POST", "/abort_requests", 200, "json", {"status": "aborted", "aborted": 0}, {}),
    Case("POST", "/abort_requests", 200, "json", {"status": "aborted", "aborted": 0}, {"request_ids": []}),
    Case("POST", "/abort_requests", 400, "json", _bad(None, "Request body must be a JSON object"), [1]),
    Case("POST", "/abort_requests", 400, "json", _bad(None, "Invalid JSON format"), raw="xx"),
    Case("POST", "/collective_rpc", 400, "json", _bad(None, "Missing 'method' in request body"), {}),
    Case(
        "POST",
        "/collective_rpc",
        400,
        "json",
        _bad(None, "JSON decode error: Expecting value: line 1 column 1 (char 0)"),
        raw="xx",
    ),  # fmt: skip
    Case("POST", "/collective_rpc", 400, "json", _bad(None, "Request body must be a JSON object"), [1]),
    Case(
        "POST",
        "/collective_rpc",
        400,
        "json",
        {"error.type": "BadRequestError", "error.message": "'int' object is not iterable"},
        {"method": "loom_reload_weights", "args": 5},
    ),  # fmt: skip
    Case(
        "POST",
        "/collective_rpc",
        200,
        "json",
        {"results.0.loaded": False},
        {"method": "loom_reload_weights", "kwargs": {"weights_path": "/nonexistent"}},
    ),  # fmt: skip
    Case(
        "POST",
        "/collective_rpc",
        200,
        "json",
        {"results.0.loaded": False},
        {"method": "loom_reload_weights", "args": ["/nonexistent"]},
    ),  # fmt: skip
    Case(
        "POST",
        "/collective_rpc",
        200,
        "json",
        {"results.0.loaded": False},
        {"method": "loom_reload_weights", "kwargs": {"weights_path": 5}},
    ),  # fmt: skip
    Case(
        "POST",
        "/collective_rpc",
        500,
        "json",
        {"error.type": "InternalServerError", "error.code": 500},
        {"method": "loom_reload_weights"},
    ),  # fmt: skip
    Case(
        "POST",
        "/collective_rpc",
        500,
        "json",
        {"error.type": "InternalServerError", "error.code": 500},
        {"method": "no_such_method"},
    ),  # fmt: skip
    Case("GET", "/health", 200, "empty"),  # the server lives on after a 500
    Case("POST", "/v1/load_lora_adapter", 400, "json", _bad("body.lora_name"), {}),
    Case("POST", "/v1/load_lora_adapter", 400, "json", _bad("body.lora_path"), {"lora_name": "a"}),
    Case(
        "POST",
        "/v1/load_lora_adapter",
        400,
        "json",
        _bad("body.lora_path"),
        {"lora_name": "a", "lora_path": 5},
    ),
    Case("POST", "/v1/load_lora_adapter", 400, "json", _bad("body"), []),
    Case("POST", "/v1/load_lora_adapter", 400, "json", _bad("body.0"), raw="xx"),
    Case("POST", "/v1/load_lora_adapter", 400, "json", _bad(None), raw="{}", content_type="text/plain"),
    Case(
        "POST",
        "/v1/load_lora_adapter",
        400,
        "json",
        {
            "error.type": "InvalidUserInput",
            "error.message": "Both 'lora_name' and 'lora_path' must be provided.",
        },
        {"lora_name": "", "lora_path": "/x"},
    ),  # fmt: skip
    Case(
        "POST",
        "/v1/load_lora_adapter",
        400,
        "json",
        {
            "error.type": "InvalidUserInput",
            "error.message": "The lora adapter '{served}' conflicts with a served base model.",
        },
        {"lora_name": "{served}", "lora_path": "/tmp"},
    ),  # fmt: skip
    Case(
        "POST",
        "/v1/load_lora_adapter",
        404,
        "json",
        {
            "error.type": "NotFoundError",
            "error.message": "Loading lora a failed: No adapter found for /nonexistent",
        },
        {"lora_name": "a", "lora_path": "/nonexistent"},
    ),  # fmt: skip
    Case(
        "POST",
        "/v1/load_lora_adapter",
        500,
        "json",
        {"error.type": "InternalServerError"},
        {"lora_name": "a", "lora_path": "bad\x00path"},
    ),  # fmt: skip
    Case(
        "POST",
        "/v1/unload_lora_adapter",
        404,
        "json",
        {
            "error.type": "NotFoundError",
            "error.message": f"The lora adapter '{MISSING_ADAPTER}' cannot be found.",
        },
        {"lora_name": MISSING_ADAPTER},
    ),  # fmt: skip
    Case(
        "POST",
        "/v1/unload_lora_adapter",
        400,
        "json",
        {
            "error.type": "InvalidUserInput",
            "error.message": "'lora_name' needs to be provided to unload a LoRA adapter.",
        },
        {"lora_name": ""},
    ),  # fmt: skip
    Case("POST", "/v1/unload_lora_adapter", 400, "json", _bad("body.lora_name"), {}),
    Case("GET", "/no-such-route", 404, "json", {"detail": "Not Found"}),
]

# routes that exist only in dev mode (VLLM_SERVER_DEV_MODE=1) / with runtime LoRA updating
DEV_ROUTES = [
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/abort_requests"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"),
    ("GET", "/server_info"),
]
LORA_ROUTES = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")]


def _fill(value: Any, served: str) -> Any:
    if isinstance(value, str):
        return value.replace("{served}", served)
    if isinstance(value, dict):
        return {k: _fill(v, served) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, served) for v in value]
    return value


def _at(doc: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def send(client: httpx.Client, case: Case, served: str) -> httpx.Response:
    if case.raw is not None:
        return client.request(
            case.method, case.path, content=case.raw, headers={"content-type": case.content_type}
        )
    if case.body is NO_BODY:
        return client.request(case.method, case.path)
    return client.request(case.method, case.path, json=_fill(case.body, served))


def problems(r: httpx.Response, case: Case, served: str) -> list[str]:
    """How ``r`` differs from vLLM's answer to ``case`` (empty: it answers as vLLM does)."""
    out = []
    if r.status_code != case.status:
        out.append(f"status {r.status_code}, vLLM answers {case.status}: {r.text[:300]}")
    ctype = r.headers.get("content-type")
    if case.reply == "json":
        if ctype != "application/json":
            out.append(f"content-type {ctype!r}, vLLM answers application/json")
            return out
        doc = r.json()
        for key, want in _fill(case.expect or {}, served).items():
            try:
                got = _at(doc, key)
            except (KeyError, IndexError, TypeError):
                out.append(f"no {key} in {doc}")
                continue
            if got != want:
                out.append(f"{key} = {got!r}, vLLM answers {want!r}")
    else:
        if ctype is not None:
            out.append(f"content-type {ctype!r}: vLLM sends a bare body with no content type")
        want_text = "" if case.reply == "empty" else _fill(case.expect, served)
        if r.text != want_text:
            out.append(f"body {r.text[:200]!r}, vLLM answers {want_text!r}")
    return out
