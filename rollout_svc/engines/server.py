"""``loom engine``: the torch engine behind the same HTTP protocol as a vLLM 0.32 server.

Routes (vLLM's names and shapes, so the ``vllm`` engine client is exercised against it):
``POST /v1/completions`` (token-id prompts, ``return_token_ids``, ``stop_token_ids``, log-probs);
the control plane (``/health``, ``/v1/models``, LoRA loading, the dev-mode routes: ``control.py``,
answered as vLLM answers, dev mode and LoRA updating gated by vLLM's own environment variables);
plus ``GET /loom/stats`` (prefill accounting) and ``POST /v1/score/attention`` (FCI scores; the
learner's route and body).
``--simulate-ms-per-token`` serves the SIMULATED engine instead (replica-scaling bench only).
Bind it to a private network: like vLLM's dev routes, the control routes have no auth.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from loom.schemas import SamplingParams
from rollout_svc.engines.base import Completion, Engine, EngineError
from rollout_svc.engines.control import attach_control_routes

log = logging.getLogger("loom.engine.server")


def _error(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    # vLLM's ErrorResponse shape
    return JSONResponse(
        status_code=status,
        content={"error": {"message": message, "type": kind, "param": None, "code": status}},
    )


# the boolean request flags /v1/completions reads or accepts; each must be a JSON boolean (or null)
_BOOL_FLAGS = (
    "stream",
    "echo",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "return_token_ids",
    "return_tokens_as_token_ids",
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


def _int_field(body: dict[str, Any], key: str, default: int, minimum: int) -> int:
    """``body[key]`` as an integer >= ``minimum`` (a JSON integer: no bool, no float); absent or null
    gives ``default``."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{key} must be >= {minimum}, got {value}")
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")


def _check_flags(body: dict[str, Any]) -> None:
    for key in _BOOL_FLAGS:
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ValueError(f"{key} must be a boolean, got {body[key]!r}")


def _params(body: dict[str, Any]) -> SamplingParams:
    _check_flags(body)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and (
        not isinstance(stop_token_ids, list)
        or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_token_ids)
    ):
        raise ValueError(f"stop_token_ids must be a list of integers, got {stop_token_ids!r}")
    return SamplingParams(
        n=_int_field(body, "n", 1, 1),
        max_tokens=_int_field(body, "max_tokens", 16, 1),
        temperature=float(body["temperature"]) if body.get("temperature") is not None else 1.0,
        top_p=float(body["top_p"]) if body.get("top_p") is not None else 1.0,
        top_k=int(body["top_k"]) if body.get("top_k") not in (None, 0) else -1,
        seed=body.get("seed"),
        stop=_stop(body),
        stop_token_ids=list(stop_token_ids or []),
        logprobs=_int_field(body, "logprobs", 0, 0),
    )


def _choice(index: int, c: Completion, prompt_ids: list[int], body: dict[str, Any], tokenizer: Any) -> dict:
    text = ""
    if tokenizer is not None:
        text = tokenizer.decode(c.token_ids, skip_special_tokens=body.get("skip_special_tokens", True))
        if isinstance(c.stop_reason, str) and not body.get("include_stop_str_in_output"):
            text = text[: text.find(c.stop_reason)] if c.stop_reason in text else text
    as_ids = bool(body.get("return_tokens_as_token_ids"))

    def tok(t: int) -> str:
        if as_ids or tokenizer is None:
            return f"token_id:{t}"
        return str(tokenizer.convert_ids_to_tokens(t))

    logprobs = None
    if body.get("logprobs") is not None:
        offsets, at = [], 0
        for t in c.token_ids:  # vLLM's text_offset: each token's first character in the text
            offsets.append(at)
            if tokenizer is not None:
                at += len(tokenizer.decode([t], skip_special_tokens=False))
        logprobs = {
            "text_offset": offsets,
            "token_logprobs": c.logprobs,
            "tokens": [tok(t) for t in c.token_ids],
            "top_logprobs": [{tok(k): v for k, v in d.items()} for d in c.top_logprobs]
            if c.top_logprobs is not None
            else None,
        }
    choice: dict[str, Any] = {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": c.finish_reason,
        "stop_reason": c.stop_reason,
    }
    if body.get("return_token_ids"):
        choice["token_ids"] = c.token_ids
        choice["prompt_token_ids"] = prompt_ids
    return choice


def create_engine_app(
    engine: Engine, model_name: str, tokenizer: Any = None, model_path: str | None = None
) -> FastAPI:
    """``model_path``: the checkpoint served (``/v1/models`` root; reloads are checked against it)."""
    app = FastAPI(title="Loom engine (vLLM-compatible)")
    app.state.engine = engine
    served = {model_name}  # the served name and every LoRA adapter loaded under its own name
    attach_control_routes(app, engine, model_name, model_path or model_name, served)

    def unknown_model(body: dict[str, Any]) -> JSONResponse | None:
        """vLLM's answer to a request naming a model it does not serve (a missing name is the served one)."""
        name = body.get("model")
        if name is None:
            return None
        if not isinstance(name, str):
            return _error(400, "model must be a string")
        if name in served:
            return None
        return _error(404, f"The model `{name}` does not exist.", "NotFoundError")

    @app.get("/loom/stats")
    async def stats() -> dict[str, Any]:
        return {"engine": engine.name, "policy_version": engine.policy_version, **asdict(engine.stats)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await _json_object(request)
        if isinstance(body, JSONResponse):
            return body
        if (missing := unknown_model(body)) is not None:
            return missing
        try:
            params = _params(body)
        except (ValidationError, ValueError, TypeError) as exc:
            return _error(400, f"invalid sampling parameters: {exc}")
        if body.get("stream"):
            return _error(400, "stream=true is not supported by loom engine")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, str) and tokenizer is not None:
            prompt = tokenizer.encode(prompt, add_special_tokens=False)
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        ):
            return _error(400, "prompt must be one non-empty list of token ids")
        try:
            outs = await engine.generate(prompt, params)
        except ValueError as exc:
            return _error(400, str(exc))
        except EngineError as exc:
            return _error(400, str(exc))
        cached = outs[0].cached_tokens if outs else 0  # this request's own (not the engine's since)
        n_out = sum(len(c.token_ids) for c in outs)
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": body.get("model") or model_name,
                "choices": [_choice(i, c, prompt, body, tokenizer) for i, c in enumerate(outs)],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n_out,
                    "total_tokens": len(prompt) + n_out,
                    "prompt_tokens_details": {"cached_tokens": cached},
                },
            }
        )

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
    return create_engine_app(engine, model or settings.model, engine.tokenizer, str(path))


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
