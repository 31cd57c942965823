"""The control plane of ``loom engine``, answered as a vLLM 0.32 server answers it (docs/vllm.md).

Status codes, JSON versus plain text and the dev-mode gating are vLLM's, pinned against a real vLLM
server by tests/vllm_server/test_protocol.py, so a client that works here does what vLLM would make it do:
- always: ``GET /health`` (200, empty body), ``GET /version``, ``GET /v1/models`` (the base model's
  card with ``root`` = its checkpoint, ``parent`` null, ``max_model_len``; one card per adapter);
- ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``: ``POST /v1/load_lora_adapter`` and
  ``/v1/unload_lora_adapter``: vLLM's refusals of a bad request, in vLLM's order; then a valid
  adapter is served under its own name beside the untouched base (``Engine.adapted``: on the torch
  engine a view whose rows decode in the base's batches with their own adapter), at most ``max_loras`` at once
  (beyond: 400, ``lora_limit``), an adapter whose tensors are not LoRA factors of the base's
  projections refused with the reason (400, no path in it). An unload drops that engine; an unknown
  name is vLLM's 404 (docs/vllm.md).
- ``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc`` (method ``loom_reload_weights``: the worker
  extension's contract, ``{"results": [{"loaded": ...}]}``; an unknown method is vLLM's 500),
  ``/reset_prefix_cache`` (``{"success": false}`` while requests run), ``/pause`` (``mode`` abort,
  wait or keep), ``/resume``, ``/is_paused``, ``/abort_requests``, ``/update_weight_version``,
  ``/weight_info``, ``/server_info`` (the parts Loom reads: the log-prob mode).
Without the flag a route is FastAPI's 404 ``{"detail": "Not Found"}``, as on vLLM.

Pausing holds new generation requests at the door until ``/resume`` and waits for those running.
Where the torch engine differs from vLLM: it cannot cut a running generation, so ``mode=abort``
waits like ``wait`` and ``/abort_requests`` aborts nothing (answers ``aborted: 0``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from loom.contracts.wire import PolicyVersion
from rollout_svc.engines.base import Engine, EngineError
from rollout_svc.engines.openai_api import server_info_answer
from rollout_svc.engines.vllm import VLLM_VERSION
from rollout_svc.engines.vllm_worker import RELOAD_METHOD, checkpoint_problem

# the routes that generate: held while paused, counted while they run
GENERATION_ROUTES = frozenset(
    {"/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/v1/score/attention"}
)
PAUSE_MODES = ("abort", "wait", "keep")
# the query-string booleans FastAPI (so vLLM) accepts
BOOLS = {
    "true": True,
    "1": True,
    "yes": True,
    "on": True,
    "false": False,
    "0": False,
    "no": False,
    "off": False,
}


def dev_mode_from_env() -> bool:
    """vLLM's own parsing of ``VLLM_SERVER_DEV_MODE`` (an integer)."""
    try:
        return bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))
    except ValueError:
        return False


def lora_updating_from_env() -> bool:
    """vLLM's own parsing of ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def vllm_error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    """vLLM's ErrorResponse."""
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": param, "code": status}},
    )


def validation_error(loc: str, kind: str, msg: str, value: Any) -> JSONResponse:
    """vLLM's answer to a body or query that fails its schema: 400 "Bad Request" naming ``loc``."""
    detail = {"type": kind, "loc": loc, "msg": msg, "input": str(value)}
    return vllm_error(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


@dataclass
class ControlState:
    weights_path: str  # the checkpoint served now (moved by reloads)
    weight_version: str = "default"
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    running: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.resumed.set()
        self.idle.set()


class _NotJSON:
    """The body of a request that is not JSON (``error``: the decoder's message)."""

    def __init__(self, error: str) -> None:
        self.error = error


async def _body(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        return _NotJSON(str(exc))


def attach_control_routes(
    app: FastAPI,
    engine: Engine,
    model_name: str,
    model_path: str,
    served: set[str],
    engines: dict[str, Engine] | None = None,
    *,
    dev_mode: bool | None = None,
    lora_updating: bool | None = None,
    max_loras: int = 2,
) -> ControlState:
    """Add the control routes and the pause gate to ``app``; ``served`` is the set of model names
    requests may use (the base and every loaded adapter) and ``engines`` each adapter's engine by
    its name, both shared with the generation routes; ``max_loras``: the adapters held at once."""
    state = ControlState(weights_path=model_path)
    app.state.control = state
    adapters: dict[str, str] = {}  # adapter name -> path
    _attach_pause_gate(app, state)
    _attach_info_routes(app, engine, model_name, model_path, adapters)
    if lora_updating_from_env() if lora_updating is None else lora_updating:
        lora = _Loras(engine, model_name, served, adapters, {} if engines is None else engines, max_loras)
        _attach_lora_routes(app, lora)
    if dev_mode_from_env() if dev_mode is None else dev_mode:
        _attach_dev_routes(app, engine, model_name, state)
    return state


def _attach_pause_gate(app: FastAPI, state: ControlState) -> None:
    """Generation requests wait at the door while paused, and are counted while they run (a
    streamed answer until its last chunk)."""

    @app.middleware("http")
    async def pause_gate(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path not in GENERATION_ROUTES:
            return await call_next(request)
        await state.resumed.wait()
        state.running += 1
        state.idle.clear()

        def done() -> None:
            state.running -= 1
            if state.running == 0:
                state.idle.set()

        try:
            response = await call_next(request)
        except BaseException:
            done()
            raise
        body = getattr(response, "body_iterator", None)
        if body is None:
            done()
            return response

        async def counted() -> AsyncIterator[Any]:  # a streamed answer runs until its last chunk
            try:
                async for chunk in body:
                    yield chunk
            finally:
                done()

        response.body_iterator = counted()  # type: ignore[attr-defined]
        return response


def _attach_info_routes(
    app: FastAPI, engine: Engine, model_name: str, model_path: str, adapters: dict[str, str]
) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": VLLM_VERSION})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "loom",
                "root": root,
                "parent": parent,
                "max_model_len": engine.max_model_len if parent is None else None,
                "permission": [],
                "loom_engine": engine.name,
                "loom_policy_version": engine.policy_version,
            }

        cards = [card(model_name, model_path, None)]  # vLLM: the --model path, whatever was reloaded since
        cards += [card(name, path, model_name) for name, path in adapters.items()]
        return JSONResponse({"object": "list", "data": cards})


async def _lora_request(request: Request, need_path: bool) -> tuple[str, str] | JSONResponse:
    """(lora_name, lora_path) of a load or unload request, else vLLM's 400 for its body."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        return vllm_error(
            400,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
        )
    body = await _body(request)
    if isinstance(body, _NotJSON):
        return validation_error("body.0", "json_invalid", "JSON decode error", "<dict of 0 items>")
    if not isinstance(body, dict):
        return validation_error("body", "model_attributes_type", "Input should be a valid dictionary", body)
    for key in ("lora_name", "lora_path") if need_path else ("lora_name",):
        if key not in body:
            return validation_error(
                f"body.{key}", "missing", "Field required", f"<dict of {len(body)} items>"
            )
        if not isinstance(body[key], str):
            return validation_error(f"body.{key}", "string_type", "Input should be a valid string", body[key])
    return str(body["lora_name"]), str(body.get("lora_path", ""))


def _lora_load_refusal(
    name: str, path: str, model_name: str, adapters: dict[str, str], load_inplace: Any
) -> JSONResponse | None:
    """vLLM's refusal of an adapter load, in vLLM's order; None if the load may go ahead."""
    if not name or not path:
        return vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
    if name == model_name:
        return vllm_error(
            400, f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput"
        )
    if name in adapters and not load_inplace:
        return vllm_error(
            400,
            f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
            "InvalidUserInput",
        )
    if "\x00" in path:  # vLLM's worker fails on it ("embedded null byte"): a 500
        return vllm_error(
            500,
            "Call to add_lora method failed: Worker failed with error 'embedded null byte', please "
            "check the stack trace above for the root cause",
            "InternalServerError",
        )
    if not (Path(path) / "adapter_config.json").is_file():
        return vllm_error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
    return None


LORA_LIMIT = "BadRequestError"


def lora_limit(name: str, held: int) -> JSONResponse:
    """The answer to one adapter more than the server holds (vLLM's ``--max-loras``)."""
    return vllm_error(
        400,
        f"Loading lora {name} failed: {held} LoRA adapters are loaded, the most this server holds "
        "(LOOM_ENGINE_MAX_LORAS); unload one first",
        LORA_LIMIT,
    )


@dataclass
class _Loras:
    """The runtime adapters: each one's path (the ``/v1/models`` card) and engine, by served name."""

    base: Engine
    model_name: str
    served: set[str]
    paths: dict[str, str]
    engines: dict[str, Engine]
    max_loras: int
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or unload at a time

    async def load(self, name: str, path: str) -> Response:
        held = len(self.paths) - (name in self.paths)  # a load in place replaces its own
        if held >= self.max_loras:
            return lora_limit(name, held)
        try:
            engine = await self.base.adapted(path)
        except EngineError as exc:  # the reason from the files' headers, no server path
            return vllm_error(400, f"Loading lora {name} failed: {exc}", "BadRequestError")
        old = self.engines.get(name)
        self.engines[name], self.paths[name] = engine, path
        self.served.add(name)
        if old is not None:
            await old.close()
        return Response(status_code=200, content=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, name: str) -> Response:
        if name not in self.paths:
            return vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        self.served.discard(name)
        del self.paths[name]
        engine = self.engines.pop(name, None)
        if engine is not None:
            await engine.close()
        return Response(status_code=200, content=f"Success: LoRA adapter '{name}' removed successfully.")


def _attach_lora_routes(app: FastAPI, lora: _Loras) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Response:
        got = await _lora_request(request, need_path=True)
        if isinstance(got, JSONResponse):
            return got
        name, path = got
        load_inplace = (await request.json()).get("load_inplace")  # a JSON object: _lora_request read it
        async with lora.lock:
            refused = _lora_load_refusal(name, path, lora.model_name, lora.paths, load_inplace)
            if refused is not None:
                return refused
            return await lora.load(name, path)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(request: Request) -> Response:
        got = await _lora_request(request, need_path=False)
        if isinstance(got, JSONResponse):
            return got
        name, _ = got
        if not name:
            return vllm_error(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput"
            )
        async with lora.lock:
            return await lora.unload(name)


def _attach_dev_routes(app: FastAPI, engine: Engine, model_name: str, state: ControlState) -> None:
    """``VLLM_SERVER_DEV_MODE``'s routes: weights and the prefix cache, pausing, the weight version."""
    _attach_weight_routes(app, engine, state)
    _attach_pause_routes(app, engine, state)
    _attach_version_routes(app, engine, model_name, state)


def _bad(message: str) -> JSONResponse:  # an HTTPException(400) through vLLM's handler
    return vllm_error(400, message, "Bad Request")


def _json_object(body: Any, not_json: str) -> dict[str, Any] | JSONResponse:
    """The body as a JSON object, else vLLM's 400 (``not_json``: its message for a body not JSON,
    ``{error}`` the decoder's)."""
    if isinstance(body, _NotJSON):
        return _bad(not_json.format(error=body.error))
    if not isinstance(body, dict):
        return _bad("Request body must be a JSON object")
    return body


async def _reload(engine: Engine, state: ControlState, path: Any) -> dict[str, Any]:
    """``loom_reload_weights``, answered as the worker extension answers it."""
    if not isinstance(path, str) or not path:
        return {"loaded": False, "error": f"weights_path must be a path, got {path!r}"}
    problem = checkpoint_problem(path, state.weights_path)
    if problem is not None:
        return {"loaded": False, "error": problem, "weights_path": state.weights_path}
    meta = Path(path) / "policy.json"
    try:
        policy = (
            PolicyVersion.model_validate_json(meta.read_text())
            if meta.exists()
            else PolicyVersion(version=engine.policy_version, path=path)
        )
        await engine.load_policy(policy.model_copy(update={"path": path, "kind": "full"}))
    except (EngineError, OSError, ValueError) as exc:  # the torch engine swaps a whole model: old kept
        return {
            "loaded": False,
            "error": f"reloading {path} failed: {exc}",
            "weights_path": state.weights_path,
        }
    state.weights_path = path
    return {"loaded": True, "weights_path": path, "tied_lm_head": False}


def _attach_weight_routes(app: FastAPI, engine: Engine, state: ControlState) -> None:
    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Response:
        body = _json_object(await _body(request), "JSON decode error: {error}")
        if isinstance(body, JSONResponse):
            return body
        method = body.get("method")
        if method is None:
            return _bad("Missing 'method' in request body")
        try:  # what vLLM does with them: a TypeError here is its 400
            args, kwargs = tuple(body.get("args", [])), dict(body.get("kwargs", {}))
        except (TypeError, ValueError) as exc:
            return vllm_error(400, str(exc), "BadRequestError")
        if method == RELOAD_METHOD and (args or "weights_path" in kwargs):
            path = kwargs["weights_path"] if "weights_path" in kwargs else args[0]
            return JSONResponse({"results": [await _reload(engine, state, path)]})
        if method == RELOAD_METHOD:
            missing = "missing 1 required positional argument: 'weights_path'"
            error = f"LoomWorkerExtension.{RELOAD_METHOD}() {missing}"
        else:
            error = f"'{type(engine).__name__}' object has no attribute '{method}'"
        return vllm_error(
            500,
            f"Call to collective_rpc method failed: Worker failed with error '{error}', please check the "
            "stack trace above for the root cause",
            "InternalServerError",
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        if state.running:  # vLLM refuses while running requests hold cache blocks
            return JSONResponse({"success": False})
        await engine.reset_cache()
        return JSONResponse({"success": True})


def _attach_pause_routes(app: FastAPI, engine: Engine, state: ControlState) -> None:
    @app.post("/pause")
    async def pause(request: Request) -> JSONResponse:
        mode = request.query_params.get("mode", "abort")
        if mode not in PAUSE_MODES:
            return validation_error(
                "query.mode", "literal_error", "Input should be 'abort', 'wait' or 'keep'", mode
            )
        clear = request.query_params.get("clear_cache", "true").lower()
        if clear not in BOOLS:
            return validation_error(
                "query.clear_cache",
                "bool_parsing",
                "Input should be a valid boolean, unable to interpret input",
                clear,
            )
        state.resumed.clear()
        if mode != "keep":  # the torch engine cannot cut a generation: abort waits too
            await state.idle.wait()
            if BOOLS[clear]:
                await engine.reset_cache()
        return JSONResponse({"status": "paused"})

    @app.post("/resume")
    async def resume() -> JSONResponse:
        state.resumed.set()
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": not state.resumed.is_set()})

    @app.post("/abort_requests")
    async def abort_requests(request: Request) -> JSONResponse:
        body = _json_object(await _body(request), "Invalid JSON format")
        if isinstance(body, JSONResponse):
            return body
        ids = body.get("request_ids")
        return JSONResponse({"status": "aborted", "aborted": len(ids) if ids else 0})


def _attach_version_routes(app: FastAPI, engine: Engine, model_name: str, state: ControlState) -> None:
    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = await _body(request)
        if isinstance(body, _NotJSON):
            return validation_error("body.0", "json_invalid", "JSON decode error", "<dict of 0 items>")
        if not isinstance(body, dict) or "new_version" not in body:
            return validation_error("body.new_version", "missing", "Field required", None)
        if not isinstance(body["new_version"], str):
            return validation_error(
                "body.new_version", "string_type", "Input should be a valid string", body["new_version"]
            )
        state.weight_version = body["new_version"]
        return JSONResponse({"success": True, "new_version": state.weight_version})

    @app.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": state.weight_version})

    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> JSONResponse:
        return server_info_answer(engine, state.weights_path, model_name, config_format)
