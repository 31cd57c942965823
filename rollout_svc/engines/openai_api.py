"""vLLM 0.32's OpenAI-compatible routes over any Loom engine (docs/interop-engine.md).

Served by ``loom engine`` (server.py) and by the rollout service under ``/engine`` (api.py), so the
trainers' own clients talk to Loom unchanged: the ``openai`` client, TRL's ``VLLMClient``.

Routes: ``POST /v1/completions`` (a string, a list of strings, a list of token ids or a list of
them; ``echo``; SSE streaming), ``POST /v1/chat/completions`` (the model's chat template; streaming),
``POST /v1/chat/completions/batch`` (several conversations, vLLM's batch route), ``GET /server_info``
and ``GET /get_world_size`` (what TRL reads), and the NCCL weight-transfer routes, refused with 501
naming themselves (loom engine loads checkpoints from disk instead: ``/collective_rpc``).

Reading requests and writing answers is openai_protocol.py's; here the engine runs them: every
prompt of a request at once (the torch engine batches them), token by token for a stream
(``Engine.stream``). Where loom engine and vLLM differ, vLLM is right: tests/interop/engine replays
what vLLM 0.32 answered.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from loom.schemas import SamplingParams
from rollout_svc.engines.base import Completion, Engine, EngineError, PromptLogprobs
from rollout_svc.engines.openai_protocol import (
    CHAT_ONLY,
    COMPLETION_ONLY,
    FINGERPRINT,
    MAX_LOGPROBS,
    SAMPLING,
    Body,
    Job,
    OpenAIError,
    Streamer,
    Text,
    chat_logprobs,
    check_fields,
    check_ids,
    completion_logprobs,
    completion_prompts,
    conversation,
    engine_error,
    final_text,
    generation_defaults,
    logprobs_count,
    max_tokens_for,
    prompt_logprobs_field,
    render_chat,
    sample_entries,
    sampling,
    sse,
    truncate,
    usage,
    with_prompt,
)


class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="BadRequestError, NotFoundError, NotImplementedError, ...")
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """vLLM's error answer (``{"error": {message, type, param, code}}``), which OpenAI clients parse;
    the engine routes answer their own errors in it (Loom's own routes answer ``ErrorBody``)."""

    error: ErrorInfo


ENGINE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "A request vLLM would refuse (vLLM's error shape)"},
    404: {"model": ErrorResponse, "description": "No such model name (vLLM's error shape)"},
}


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.body())


@dataclass
class Served:
    """What the routes serve: the engine and tokenizer (got on first use: the rollout service builds
    its engine lazily), the model names a request may give, and the model's sampling defaults."""

    engine: Callable[[], Awaitable[Engine]]
    tokenizer: Callable[[], Awaitable[Any]]
    model_name: str
    names: set[str]
    model_path: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)


async def run(engine: Engine, job: Job) -> tuple[list[list[Completion]], list[PromptLogprobs | None]]:
    """Every prompt's samples (all prompts at once: the torch engine batches them) and prompt log-probs."""
    plps: list[PromptLogprobs | None] = [None] * len(job.prompts)
    if job.prompt_k is not None:
        plps = list(
            await asyncio.gather(*(engine.prompt_logprobs(ids, job.prompt_k) for ids, _ in job.prompts))
        )
    outs = await asyncio.gather(
        *(engine.generate(ids, p) for (ids, _), p in zip(job.prompts, job.params, strict=True))
    )
    return list(outs), plps


async def merged(engine: Engine, job: Job) -> AsyncIterator[tuple[int, Any]]:
    """Every prompt's progress, as it comes: (prompt index, Progress)."""
    queue: asyncio.Queue[tuple[int, Any] | BaseException | None] = asyncio.Queue()

    async def pump(i: int) -> None:
        ids, _ = job.prompts[i]
        try:
            async for progress in engine.stream(ids, job.params[i]):
                await queue.put((i, progress))
        except Exception as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i)) for i in range(len(job.prompts))]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def first_then_rest(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Wait for the first event before the answer starts: an engine error there (a prompt the model
    cannot read) is still a JSON 400, not an error inside a 200 stream."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:
        return events

    async def rest() -> AsyncIterator[Any]:
        yield first
        async for item in events:
            yield item

    return rest()


# ------------------------------------------------------------------------------------------------
# the routes


def server_info_answer(engine: Engine, model: str, served_name: str, config_format: str) -> JSONResponse:
    """vLLM's (dev-mode) ``/server_info``, the parts TRL and trainers read: no weight-transfer engine
    (TRL's ``init_communicator`` stops there with its own message)."""
    if config_format not in ("text", "json"):
        return error_response(OpenAIError("config_format must be 'text' or 'json'", "config_format"))
    config = {
        "model_config": {
            "model": model,
            "served_model_name": served_name,
            "tokenizer": model,
            "max_model_len": engine.max_model_len,
            "max_logprobs": MAX_LOGPROBS,
            "logprobs_mode": f"{engine.logprobs_kind}_logprobs",
            "dtype": "torch.float32",
            "generation_config": "auto",
        },
        "parallel_config": {
            "pipeline_parallel_size": 1,
            "tensor_parallel_size": 1,
            "data_parallel_size": 1,
            "world_size": 1,
        },
        "weight_transfer_config": None,
        "loom": {"engine": engine.name, "policy_version": engine.policy_version},
    }
    shown: Any = config if config_format == "json" else json.dumps(config)
    return JSONResponse({"vllm_config": shown, "vllm_env": {}, "system_env": {}})


def create_router(served: Served, server_info: bool = True) -> APIRouter:
    """The generation routes; ``server_info``: also ``GET /server_info`` (``loom engine`` has it only
    in vLLM's dev mode, from control.py, as vLLM does)."""
    router = APIRouter(responses=ENGINE_ERRORS)

    def model_of(body: Body) -> str:
        name = body.data.get("model")
        if name is None:
            return served.model_name
        if not isinstance(name, str):
            raise OpenAIError("model must be a string", "model")
        if name not in served.names:
            aliases = ", ".join(sorted(served.names))
            raise OpenAIError(f"The model `{name}` does not exist. Valid aliases: {aliases}.", "model", 404)
        return name

    async def read(request: Request) -> Body:
        try:
            data = await request.json()
        except ValueError:
            raise OpenAIError("body is not valid JSON") from None
        if not isinstance(data, dict):
            raise OpenAIError(f"body must be a JSON object, not {type(data).__name__}")
        return Body(data)

    def stream_flags(body: Body) -> tuple[bool, bool, bool, int]:
        stream = body.boolean("stream", False)
        options = body.data.get("stream_options")
        if options is not None and not stream:
            raise OpenAIError("Stream options can only be defined when `stream=True`.", "stream_options")
        if options is not None and not isinstance(options, dict):
            raise OpenAIError("stream_options must be an object", "stream_options")
        opts = Body(options or {})
        interval = body.integer("stream_interval", 1, 1)
        assert interval is not None
        return (
            stream,
            opts.boolean("include_usage", False),
            opts.boolean("continuous_usage_stats", False),
            interval,
        )

    def request_id(body: Body, prefix: str) -> str:
        rid = body.data.get("request_id")
        return f"{prefix}-{rid if isinstance(rid, str) and rid else uuid.uuid4().hex}"

    def text_of(body: Body, tokenizer: Any) -> Text:
        for key in ("echo", "include_stop_str_in_output", "return_token_ids"):
            body.boolean(key, False)
        return Text(
            tokenizer,
            as_ids=body.boolean("return_tokens_as_token_ids", False),
            skip_special=body.boolean("skip_special_tokens", True),
            spaces_between_special=body.boolean("spaces_between_special_tokens", True),
        )

    # -------------------------------------------------------------------------------- completions

    @router.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body = await read(request)
            check_fields(body, SAMPLING | COMPLETION_ONLY)
            model = model_of(body)
            engine, tokenizer = await served.engine(), await served.tokenizer()
            stream, include_usage, continuous, interval = stream_flags(body)
            logprobs = logprobs_count(body.data.get("logprobs"), "logprobs", engine.vocab_size)
            prompt_k = logprobs_count(body.data.get("prompt_logprobs"), "prompt_logprobs", engine.vocab_size)
            echo = body.boolean("echo", False)
            if prompt_k is None and echo and logprobs is not None:
                prompt_k = logprobs  # vLLM: echoed prompt tokens get log-probs too
            if stream and prompt_k is not None and body.data.get("prompt_logprobs") is not None:
                raise OpenAIError(
                    "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
                )
            text = text_of(body, tokenizer)
            prompts = completion_prompts(body, tokenizer, engine.vocab_size)
            prompts = [(truncate(ids, body, engine.max_model_len), s) for ids, s in prompts]
            requested = body.integer("max_tokens", 16)
            assert requested is not None
            echo_only = echo and requested == 0
            if requested < 1 and not echo_only:
                raise OpenAIError(f"max_tokens must be at least 1, got {requested}.", "max_tokens")
            params: list[SamplingParams] = []
            for ids, _ in prompts:
                limit = max_tokens_for(requested, len(ids), engine.max_model_len, "max_tokens")
                limit = 1 if echo_only else limit  # vLLM generates one token it does not show
                params.append(sampling(body, served.defaults, limit, logprobs or 0, engine.vocab_size))
            job = Job(prompts, params, text, body.boolean("include_stop_str_in_output", False), prompt_k)
            rid = request_id(body, "cmpl")
            if stream:
                plps: list[PromptLogprobs | None] = [None] * len(prompts)
                if prompt_k is not None:  # echo with log-probs: the first chunk carries the prompt's
                    plps = list(
                        await asyncio.gather(*(engine.prompt_logprobs(ids, prompt_k) for ids, _ in prompts))
                    )
                events = await first_then_rest(merged(engine, job))
                lines = stream_completion(
                    job, body, events, plps, rid, model, include_usage, continuous, interval, logprobs
                )
                return StreamingResponse(lines, media_type="text/event-stream")
            outs, plps = await run(engine, job)
        except OpenAIError as exc:
            return error_response(exc)
        except (EngineError, ValueError) as exc:
            return error_response(engine_error(exc))
        return JSONResponse(completion_answer(job, body, outs, plps, rid, model, logprobs, echo_only))

    def completion_answer(
        job: Job,
        body: Body,
        outs: list[list[Completion]],
        plps: list[PromptLogprobs | None],
        rid: str,
        model: str,
        logprobs: int | None,
        echo_only: bool,
    ) -> dict[str, Any]:
        echo, with_ids = body.boolean("echo", False), body.boolean("return_token_ids", False)
        t = job.text
        choices: list[dict[str, Any]] = []
        n_prompt = n_out = 0
        cached = 0
        for (ids, prompt_text), params, samples, plp in zip(job.prompts, job.params, outs, plps, strict=True):
            n_prompt += len(ids)
            shown_prompt = "" if with_ids else (prompt_text if prompt_text is not None else t.decode(ids))
            for c in samples:
                n_out += len(c.token_ids)
                cached = c.cached_tokens
                out_text = final_text(c, params, job.include_stop, t)
                lp_ids: list[int] = list(c.token_ids)
                lps: list[float | None] = list(c.logprobs)
                tops: list[list[tuple[int, float]] | None] = list(sample_entries(c, logprobs or 0))
                if echo_only:
                    out_text, lp_ids, lps, tops = "", [], [], []
                if echo:
                    out_text = shown_prompt + out_text
                    if logprobs is not None and plp is not None:
                        lp_ids, lps, tops = with_prompt(ids, plp, logprobs, lp_ids, lps, tops)
                choices.append(
                    {
                        "index": len(choices),
                        "text": out_text,
                        "logprobs": None if logprobs is None else completion_logprobs(lp_ids, lps, tops, t),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "token_ids": list(c.token_ids) if with_ids else None,
                        "prompt_logprobs": prompt_logprobs_field(plp, t),
                        "prompt_token_ids": list(ids) if with_ids else None,
                        "routed_experts": None,
                    }
                )
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": usage(n_prompt, n_out, cached),
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    async def stream_completion(
        job: Job,
        body: Body,
        events: AsyncIterator[tuple[int, Any]],
        plps: list[PromptLogprobs | None],
        rid: str,
        model: str,
        include_usage: bool,
        continuous: bool,
        interval: int,
        logprobs: int | None,
    ) -> AsyncIterator[str]:
        echo, with_ids = body.boolean("echo", False), body.boolean("return_token_ids", False)
        n = job.params[0].n
        created = int(time.time())
        streamers: dict[int, Streamer] = {}
        started: set[int] = set()
        sent_tokens = dict.fromkeys(range(len(job.prompts) * n), 0)
        t = job.text
        try:
            async for i, progress in events:
                index = i * n + progress.sample
                params = job.params[i]
                s = streamers.setdefault(index, Streamer(job, params))
                c = progress.completion
                if not progress.ended and index in started and progress.tokens - s.tokens < interval:
                    continue
                new, delta = s.advance(c, progress.tokens, progress.ended)
                start = len(c.token_ids[: progress.tokens]) - len(new)
                ids, prompt_text = job.prompts[i]
                lp_ids: list[int] = list(new)
                lps: list[float | None] = list(c.logprobs[start : progress.tokens])
                tops: list[list[tuple[int, float]] | None] = list(
                    sample_entries(c, logprobs or 0, start, progress.tokens)
                )
                first = index not in started
                if first and echo:
                    shown_prompt = (
                        "" if with_ids else (prompt_text if prompt_text is not None else t.decode(ids))
                    )
                    delta = shown_prompt + delta
                    plp = plps[i]
                    if logprobs is not None and plp is not None:
                        lp_ids, lps, tops = with_prompt(ids, plp, logprobs, lp_ids, lps, tops)
                started.add(index)
                chunk_lp = None
                if logprobs is not None:
                    chunk_lp = completion_logprobs(lp_ids, lps, tops, t, s.offset)
                    s.offset += sum(len(x) for x in chunk_lp["tokens"])
                sent_tokens[index] = progress.tokens
                chunk: dict[str, Any] = {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": index,
                            "text": delta,
                            "logprobs": chunk_lp,
                            "finish_reason": c.finish_reason if progress.ended else None,
                            "stop_reason": c.stop_reason if progress.ended else None,
                            "prompt_token_ids": list(ids) if first and (echo or with_ids) else None,
                            "token_ids": list(new) if with_ids else None,
                        }
                    ],
                }
                if continuous:
                    chunk["usage"] = usage(len(ids), progress.tokens)
                    chunk["usage"].pop("prompt_tokens_details")
                    chunk["usage"].pop("completion_tokens_details")
                yield sse(chunk)
            if include_usage:
                prompt_tokens = sum(len(ids) for ids, _ in job.prompts)
                final = usage(prompt_tokens, sum(sent_tokens.values()))
                final = {k: v for k, v in final.items() if v is not None}
                yield sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": final,
                        "system_fingerprint": FINGERPRINT,
                    }
                )
        except Exception as exc:  # after the 200 has gone out: vLLM's in-stream error
            yield sse(engine_error(exc).body())
        yield sse("[DONE]")

    # -------------------------------------------------------------------------------- chat

    async def chat_job(
        body: Body, conversations: list[Any], engine: Engine, tokenizer: Any
    ) -> tuple[Job, list[list[dict[str, Any]]], int]:
        logprobs_on = body.boolean("logprobs", False)
        top = logprobs_count(body.data.get("top_logprobs"), "top_logprobs", engine.vocab_size)
        if top and not logprobs_on:
            raise OpenAIError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        k = (top or 0) if logprobs_on else 0
        prompt_k = logprobs_count(body.data.get("prompt_logprobs"), "prompt_logprobs", engine.vocab_size)
        text = text_of(body, tokenizer)
        convs: list[list[dict[str, Any]]] = []
        prompts: list[tuple[list[int], str | None]] = []
        params: list[SamplingParams] = []
        for messages in conversations:
            conv = conversation(messages, served.model_name)
            ids, rendered = render_chat(body, conv, tokenizer)
            ids = truncate(ids, body, engine.max_model_len)
            check_ids(ids, engine.vocab_size)
            key = (
                "max_completion_tokens"
                if body.data.get("max_completion_tokens") is not None
                else "max_tokens"
            )
            requested = body.integer(key, served.defaults.get("max_tokens"), 1)
            limit = max_tokens_for(requested, len(ids), engine.max_model_len, key)
            convs.append(conv)
            prompts.append((ids, rendered))
            params.append(sampling(body, served.defaults, limit, k, engine.vocab_size))
        return (
            Job(prompts, params, text, body.boolean("include_stop_str_in_output", False), prompt_k),
            convs,
            k,
        )

    def chat_choice(
        body: Body,
        conv: list[dict[str, Any]],
        c: Completion,
        params: SamplingParams,
        job: Job,
        k: int,
        index: int,
    ) -> dict[str, Any]:
        t = job.text
        role = "assistant" if body.boolean("add_generation_prompt", True) else conv[-1]["role"]
        content = final_text(c, params, job.include_stop, t)
        if body.boolean("echo", False) and conv and conv[-1].get("role") == role:
            content = conv[-1]["content"] + content
        lp = None
        if body.boolean("logprobs", False):
            lp = chat_logprobs(c.token_ids, c.logprobs, sample_entries(c, k), k, t)
        return {
            "index": index,
            "message": {
                "role": role,
                "content": content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids) if body.boolean("return_token_ids", False) else None,
            "routed_experts": None,
        }

    def chat_answer(
        rid: str, model: str, choices: list[dict[str, Any]], n_prompt: int, n_out: int, extra: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": usage(n_prompt, n_out),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
            **extra,
        }

    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = await read(request)
            check_fields(body, SAMPLING | CHAT_ONLY)
            model = model_of(body)
            engine, tokenizer = await served.engine(), await served.tokenizer()
            stream, include_usage, continuous, interval = stream_flags(body)
            if stream and body.data.get("prompt_logprobs") is not None:
                raise OpenAIError(
                    "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
                )
            job, (conv,), k = await chat_job(body, [body.data.get("messages")], engine, tokenizer)
            rid = request_id(body, "chatcmpl")
            if stream:
                events = await first_then_rest(merged(engine, job))
                lines = stream_chat(
                    job, body, conv, events, rid, model, include_usage, continuous, interval, k
                )
                return StreamingResponse(lines, media_type="text/event-stream")
            (samples,), (plp,) = await run(engine, job)
        except OpenAIError as exc:
            return error_response(exc)
        except (EngineError, ValueError) as exc:
            return error_response(engine_error(exc))
        ids, rendered = job.prompts[0]
        choices = [chat_choice(body, conv, c, job.params[0], job, k, i) for i, c in enumerate(samples)]
        extra = {
            "prompt_logprobs": prompt_logprobs_field(plp, job.text),
            "prompt_token_ids": list(ids) if body.boolean("return_token_ids", False) else None,
            "prompt_text": rendered if body.boolean("return_prompt_text", False) else None,
        }
        n_out = sum(len(c.token_ids) for c in samples)
        return JSONResponse(chat_answer(rid, model, choices, len(ids), n_out, extra))

    @router.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request) -> Any:
        """Several conversations in one request, one choice each (vLLM: no n > 1, no streaming, no tools)."""
        try:
            body = await read(request)
            check_fields(body, SAMPLING | CHAT_ONLY)
            model = model_of(body)
            if body.data.get("n") not in (None, 1):
                raise OpenAIError("Batch chat completions do not support `n > 1`. Please set `n` to 1.", "n")
            if body.data.get("stream"):
                raise OpenAIError("Batch chat completions do not support streaming.", "stream")
            if body.data.get("tools"):
                raise OpenAIError("Batch chat completions do not support tools.", "tools")
            conversations = body.data.get("messages")
            if (
                not isinstance(conversations, list)
                or not conversations
                or not all(isinstance(m, list) and m for m in conversations)
            ):
                raise OpenAIError(
                    "messages must be a non-empty list of conversations (lists of messages)", "messages"
                )
            engine, tokenizer = await served.engine(), await served.tokenizer()
            job, convs, k = await chat_job(body, conversations, engine, tokenizer)
            rid = request_id(body, "chatcmpl")
            outs, _ = await run(engine, job)
        except OpenAIError as exc:
            return error_response(exc)
        except (EngineError, ValueError) as exc:
            return error_response(engine_error(exc))
        choices = [
            chat_choice(body, conv, samples[0], params, job, k, i)
            for i, (conv, samples, params) in enumerate(zip(convs, outs, job.params, strict=True))
        ]
        n_prompt = sum(len(ids) for ids, _ in job.prompts)
        n_out = sum(len(c.token_ids) for samples in outs for c in samples)
        return JSONResponse(chat_answer(rid, model, choices, n_prompt, n_out, {}))

    async def stream_chat(
        job: Job,
        body: Body,
        conv: list[dict[str, Any]],
        events: AsyncIterator[tuple[int, Any]],
        rid: str,
        model: str,
        include_usage: bool,
        continuous: bool,
        interval: int,
        k: int,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        ids, _ = job.prompts[0]
        params = job.params[0]
        with_ids = body.boolean("return_token_ids", False)
        role = "assistant" if body.boolean("add_generation_prompt", True) else conv[-1]["role"]
        streamers: dict[int, Streamer] = {}
        started: set[int] = set()
        sent_tokens = dict.fromkeys(range(params.n), 0)

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            return sse(
                {
                    "id": rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": choices,
                    **extra,
                }
            )

        def counts(index: int) -> dict[str, Any]:
            if not continuous:
                return {}
            u = usage(len(ids), sent_tokens[index])
            return {"usage": {k2: v for k2, v in u.items() if v is not None}}

        try:
            for index in range(params.n):  # vLLM opens every choice with the role
                first = {
                    "index": index,
                    "delta": {"role": role, "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield chunk(
                    [first],
                    prompt_token_ids=list(ids) if with_ids else None,
                    prompt_text=None,
                    **counts(index),
                )
                if body.boolean("echo", False) and conv[-1].get("role") == role and conv[-1]["content"]:
                    echoed = {
                        "index": index,
                        "delta": {"content": conv[-1]["content"]},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield chunk([echoed], **counts(index))
            async for _, progress in events:
                index = progress.sample
                s = streamers.setdefault(index, Streamer(job, params))
                if not progress.ended and index in started and progress.tokens - s.tokens < interval:
                    continue
                started.add(index)
                c = progress.completion
                new, delta = s.advance(c, progress.tokens, progress.ended)
                start = progress.tokens - len(new)
                sent_tokens[index] = progress.tokens
                lp = None
                if body.boolean("logprobs", False):
                    lp = chat_logprobs(
                        new,
                        c.logprobs[start : progress.tokens],
                        sample_entries(c, k, start, progress.tokens),
                        k,
                        job.text,
                    )
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": {"content": delta},
                    "logprobs": lp,
                    "finish_reason": c.finish_reason if progress.ended else None,
                }
                if progress.ended:
                    choice["stop_reason"] = c.stop_reason
                choice["token_ids"] = list(new) if with_ids else None
                yield chunk([choice], **counts(index))
            if include_usage:
                u = usage(len(ids), sum(sent_tokens.values()))
                yield chunk(
                    [], usage={k2: v for k2, v in u.items() if v is not None}, system_fingerprint=FINGERPRINT
                )
        except Exception as exc:  # after the 200 has gone out: vLLM's in-stream error
            yield sse(engine_error(exc).body())
        yield sse("[DONE]")

    # -------------------------------------------------------------------------------- TRL's routes

    if server_info:

        @router.get("/server_info")
        async def info(config_format: str = "text") -> Any:
            engine = await served.engine()
            model = served.model_path or served.model_name
            return server_info_answer(engine, model, served.model_name, config_format)

    @router.get("/get_world_size")
    async def get_world_size() -> dict[str, int]:
        return {"world_size": 1}  # one engine process: tensor, pipeline and data parallel sizes of 1

    for route in (
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
    ):
        router.add_api_route(
            route,
            _no_weight_transfer(route),
            methods=["POST"],
            responses={501: {"model": ErrorResponse, "description": "No NCCL weight transfer"}},
        )

    return router


def _no_weight_transfer(route: str) -> Callable[[], Awaitable[JSONResponse]]:
    async def refuse() -> JSONResponse:
        err = OpenAIError(
            f"{route}: loom engine has no NCCL weight-transfer engine (vLLM's --weight-transfer-config); "
            'load a checkpoint from disk instead: POST /collective_rpc {"method": "loom_reload_weights", '
            '"args": [PATH]} (the rollout service: POST /v1/policy). See docs/interop-engine.md.',
            None,
            501,
        )
        return error_response(err)

    return refuse


def basic_routes(router: APIRouter, served: Served) -> None:
    """``/health``, ``/v1/models`` and ``/reset_prefix_cache`` (TRL calls it after a weight sync) for a
    mount that has none of its own (the rollout service)."""

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        engine = await served.engine()
        await engine.reset_cache()
        return JSONResponse({"success": True})  # vLLM 0.32's answer

    @router.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        engine = await served.engine()
        card = {
            "id": served.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "loom",
            "root": served.model_name,
            "max_model_len": engine.max_model_len,
            "loom_engine": engine.name,
            "loom_policy_version": engine.policy_version,
        }
        return {"object": "list", "data": [card]}


def engine_router(engine: Engine, model_name: str, tokenizer: Any, names: set[str]) -> APIRouter:
    """The routes over one engine built already (``loom engine``); ``names`` may grow (LoRA adapters)."""
    path = getattr(engine, "model_path", None)

    async def get_engine() -> Engine:
        return engine

    async def get_tokenizer() -> Any:
        return tokenizer

    model_path = None if path is None else str(path)
    return create_router(
        Served(get_engine, get_tokenizer, model_name, names, model_path, generation_defaults(path)),
        server_info=False,
    )
