"""``loom engine``: the torch engine behind the same HTTP protocol as a vLLM 0.11.0 server.

Routes (vLLM's names and shapes, so the ``vllm`` engine client is exercised against it):
the OpenAI surface of openai_api.py (``/v1/completions``, ``/v1/chat/completions``, TRL's routes),
``GET /v1/models``, ``GET /health``, ``POST /v1/load_lora_adapter``, ``POST /collective_rpc``
(method ``loom_reload_weights``), ``POST /reset_prefix_cache``; plus ``GET /loom/stats`` (prefill
accounting) and ``POST /v1/score/attention`` (FCI scores; the learner's route and body).
``--simulate-ms-per-token`` serves the SIMULATED engine instead (replica-scaling bench only).
Bind it to a private network: like vLLM's dev routes, the control routes have no auth.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from loom.schemas import PolicyVersion
from rollout_svc.engines.base import Engine, EngineError
from rollout_svc.engines.openai_api import engine_router
from rollout_svc.engines.vllm import RELOAD_METHOD

log = logging.getLogger("loom.engine.server")


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    # vLLM's ErrorResponse shape
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


async def _json_object(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's body as a JSON object, else a 400 (vLLM answers 400 for a malformed body)."""
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "body is not valid JSON")
    if not isinstance(body, dict):
        return _error(400, f"body must be a JSON object, not {type(body).__name__}")
    return body


def create_engine_app(engine: Engine, model_name: str, tokenizer: Any = None) -> FastAPI:
    app = FastAPI(title="Loom engine (vLLM-compatible)")
    app.state.engine = engine
    served = {model_name}  # the served name and every LoRA adapter loaded under its own name
    app.include_router(engine_router(engine, model_name, tokenizer, served))  # openai_api.py

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "loom",
            "root": model_name,
            "loom_engine": engine.name,
            "loom_policy_version": engine.policy_version,
        }
        return {"object": "list", "data": [card]}

    @app.get("/loom/stats")
    async def stats() -> dict[str, Any]:
        return {"engine": engine.name, "policy_version": engine.policy_version, **asdict(engine.stats)}

    async def _load(path: str, kind: str) -> JSONResponse | None:
        try:
            policy = _policy_at(path, kind, engine.policy_version + 1)
            await engine.load_policy(policy)
        except (EngineError, OSError, ValueError) as exc:
            return _error(400, f"could not load {path}: {exc}")
        return None

    @app.post("/v1/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return _error(400, "lora_name and lora_path are required, as non-empty strings")
        err = await _load(path, "lora")
        if err is not None:
            return err
        served.add(name)
        return JSONResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request) -> Any:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        if body.get("method") != RELOAD_METHOD:
            return _error(400, f"loom engine supports only method {RELOAD_METHOD!r}")
        args = body.get("args") or []
        if not isinstance(args, list) or len(args) != 1 or not isinstance(args[0], str):
            return _error(400, f"{RELOAD_METHOD} takes one argument: the checkpoint path")
        err = await _load(args[0], "full")
        return err or JSONResponse({"results": [engine.policy_version]})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        await engine.reset_cache()
        return JSONResponse({})

    @app.post("/v1/score/attention")
    async def score_attention(request: Request) -> JSONResponse:
        """FCI scores (loom.fci), same body and answer as the learner's route of the same name."""
        try:
            body = await request.json()
            token_ids = [int(t) for t in body["token_ids"]]
            steps = [(int(a), int(b)) for a, b in body["steps"]]
            delta = int(body.get("delta") or 4)
            zero_from = None if body.get("zero_from") is None else int(body["zero_from"])
        except (ValueError, KeyError, TypeError) as exc:
            return _error(400, f"expected token_ids, steps [[start, end], ...], delta, zero_from: {exc}")
        if delta < 1 or not steps or any(not 0 <= a < b <= len(token_ids) for a, b in steps):
            return _error(400, "every step must be a non-empty span inside token_ids and delta >= 1")
        try:
            scores = await engine.score_attention(token_ids, steps, delta, zero_from)
        except EngineError as exc:
            return _error(400, str(exc))
        return JSONResponse({"scores": scores, "policy_version": engine.policy_version})

    return app


def _policy_at(path: str, kind: str, default_version: int) -> PolicyVersion:
    """The policy-store record next to a checkpoint, else a record with the next version number."""
    meta = Path(path) / "policy.json"
    if meta.exists():
        return PolicyVersion.model_validate_json(meta.read_text())
    return PolicyVersion(version=default_version, path=path, kind=kind)  # type: ignore[arg-type]


def build_app(
    model: str | None = None, device: str | None = None, simulate_ms_per_token: float | None = None
) -> FastAPI:
    from loom.runtime import configure_process
    from loom.settings import get_settings

    settings = get_settings()
    configure_process(settings)
    if simulate_ms_per_token is not None:
        from rollout_svc.engines.simulated import SimulatedEngine

        log.warning(
            "SIMULATION MODE: %.1f ms per token, random tokens (benchmarks only)", simulate_ms_per_token
        )
        return create_engine_app(SimulatedEngine(simulate_ms_per_token), "loom-simulated")
    from rollout_svc.engines.torch_engine import TorchEngine, resolve_model_path

    path = resolve_model_path(model or settings.model)
    engine = TorchEngine(
        path,
        device=device or settings.device,
        cache_entries=settings.engine_prefix_cache_entries,
        logprobs_mode=settings.engine_logprobs_mode,
    )
    return create_engine_app(engine, model or settings.model, engine.tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    from loom.settings import get_settings

    settings = get_settings()
    p = argparse.ArgumentParser(
        prog="loom engine", description="torch engine behind a vLLM-compatible server"
    )
    p.add_argument("--host", default=settings.host)
    p.add_argument("--port", type=int, default=settings.engine_port)
    p.add_argument("--model", default=None, help="'tiny' or a Hugging Face model directory (LOOM_MODEL)")
    p.add_argument("--device", default=None)
    p.add_argument(
        "--simulate-ms-per-token",
        type=float,
        default=None,
        help="SIMULATION: no model, random tokens at this latency (replica-scaling benchmark only)",
    )
    args = p.parse_args(list(argv) if argv is not None else None)
    import uvicorn

    app = build_app(args.model, args.device, args.simulate_ms_per_token)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
