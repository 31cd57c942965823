"""``loom engine``: the torch engine behind the same HTTP protocol as a vLLM 0.32 server.

Routes (vLLM's names and shapes, so the ``vllm`` engine client is exercised against it):
the OpenAI surface of ``openai_api.py`` (``/v1/completions``, ``/v1/chat/completions``, TRL's routes);
the control plane (``/health``, ``/v1/models``, LoRA loading, the dev-mode routes: ``control.py``,
answered as vLLM answers, dev mode and LoRA updating gated by vLLM's own environment variables);
plus ``GET /loom/stats`` (prefill accounting) and ``POST /v1/score/attention`` (FCI scores; the
learner's route and body: a ``policy_version`` (+ ``policy_namespace``) other than the one this engine
serves is a 409 ``attention_version_unavailable``, never scores of another version).
``--simulate-ms-per-token`` serves the SIMULATED engine instead (replica-scaling bench only).
Bind it to a private network: like vLLM's dev routes, the control routes have no auth.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rollout_svc.engines.base import Engine, EngineError
from rollout_svc.engines.control import attach_control_routes
from rollout_svc.engines.openai_api import engine_router

log = logging.getLogger("loom.engine.server")


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    # vLLM's ErrorResponse shape
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


def create_engine_app(
    engine: Engine,
    model_name: str,
    tokenizer: Any = None,
    model_path: str | None = None,
    max_loras: int = 2,
) -> FastAPI:
    """``model_path``: the checkpoint served (``/v1/models`` root; reloads are checked against it);
    ``max_loras``: the runtime LoRA adapters held at once (vLLM's ``--max-loras``)."""
    app = FastAPI(title="Loom engine (vLLM-compatible)")
    app.state.engine = engine
    served = {model_name}  # the served name and every LoRA adapter loaded under its own name
    adapters: dict[str, Engine] = {}  # each adapter's own engine, by its served name
    # the control plane first: its /health, /v1/models and /server_info answer as vLLM's do (control.py)
    attach_control_routes(
        app, engine, model_name, model_path or model_name, served, adapters, max_loras=max_loras
    )
    app.include_router(engine_router(engine, model_name, tokenizer, served, adapters))  # openai_api.py

    @app.get("/loom/stats")
    async def stats() -> dict[str, Any]:
        return {"engine": engine.name, "policy_version": engine.policy_version, **asdict(engine.stats)}

    @app.post("/v1/score/attention")
    async def score_attention(request: Request) -> JSONResponse:
        """FCI scores (loom.fci), same body and answer as the learner's route of the same name."""
        try:
            body = await request.json()
            token_ids = [int(t) for t in body["token_ids"]]
            steps = [(int(a), int(b)) for a, b in body["steps"]]
            delta = int(body.get("delta") or 4)
            zero_from = None if body.get("zero_from") is None else int(body["zero_from"])
            version = int(body.get("policy_version") or 0)
            namespace = body.get("policy_namespace") if version else None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return _error(400, f"expected token_ids, steps [[start, end], ...], delta, zero_from: {exc}")
        if delta < 1 or not steps or any(not 0 <= a < b <= len(token_ids) for a, b in steps):
            return _error(400, "every step must be a non-empty span inside token_ids and delta >= 1")
        held = (engine.policy_namespace if engine.policy_version else None, engine.policy_version)
        if (namespace, version) != held:  # the rollout's version is not the one held: no scores
            message = f"this engine serves policy version {held[1]}, not version {version}"
            return _error(409, message, "attention_version_unavailable")
        try:
            scores = await engine.score_attention(token_ids, steps, delta, zero_from)
        except EngineError as exc:
            return _error(400, str(exc))
        return JSONResponse({"scores": scores, "policy_version": engine.policy_version})

    return app


def build_app(
    model: str | None = None, device: str | None = None, simulate_ms_per_token: float | None = None
) -> FastAPI:
    from loom.contracts.settings import get_settings
    from loom.runtime import configure_process

    settings = get_settings()
    configure_process(settings)
    if simulate_ms_per_token is not None:
        from rollout_svc.engines.simulated import SimulatedEngine

        log.warning(
            "SIMULATION MODE: %.1f ms per token, random tokens (benchmarks only)", simulate_ms_per_token
        )
        return create_engine_app(SimulatedEngine(simulate_ms_per_token), "loom-simulated")
    from rollout_svc.engines.torch import TorchEngine, resolve_model_path

    path = resolve_model_path(model or settings.model)
    engine = TorchEngine(
        path,
        device=device or settings.device,
        cache_entries=settings.engine_prefix_cache_entries,
        logprobs_mode=settings.engine_logprobs_mode,
        dtype=settings.engine_dtype,
    )
    return create_engine_app(
        engine, model or settings.model, engine.tokenizer, str(path), settings.engine_max_loras
    )


def main(argv: Sequence[str] | None = None) -> int:
    from loom.contracts.settings import get_settings

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
    from loom.service import serve

    app = build_app(args.model, args.device, args.simulate_ms_per_token)
    # the read deadlines of every Loom service (docs/security.md): a slow client is cut off here too
    serve(app, args.host, args.port, settings, log_level="warning", timeout_graceful_shutdown=3)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
