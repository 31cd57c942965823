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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from loom.contracts.wire import SamplingParams, unencodable_path
from loom.service_token import UNAUTHORIZED
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
    adapters: dict[str, Engine] = field(default_factory=dict)  # a served name -> its own engine

    async def engine_for(self, model: str) -> Engine:
        """The engine that answers for ``model``: a runtime LoRA adapter's own, else the base's."""
        adapter = self.adapters.get(model)
        return adapter if adapter is not None else await self.engine()


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


# ------------------------------------------------------------------------------------------------
# reading a request (shared by the routes)


def failure(exc: Exception) -> JSONResponse:
    """vLLM's error answer to a refused request (``OpenAIError``) or an engine's refusal."""
    return error_response(engine_error(exc))


async def read(request: Request) -> Body:
    try:
        data = await request.json()
    except ValueError:
        raise OpenAIError("body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OpenAIError(f"body must be a JSON object, not {type(data).__name__}")
    where = unencodable_path(data)  # a \ud800 escape: no tokenizer can take it (was a 500)
    if where is not None:
        param = where.lstrip(".")[:200]
        raise OpenAIError(
            f"{param}: a lone surrogate, which UTF-8 cannot encode: text must be valid Unicode", param
        )
    return Body(data)


def model_of(body: Body, served: Served) -> str:
    name = body.data.get("model")
    if name is None:
        return served.model_name
    if not isinstance(name, str):
        raise OpenAIError("model must be a string", "model")
    if name not in served.names:
        aliases = ", ".join(sorted(served.names))
        raise OpenAIError(f"The model `{name}` does not exist. Valid aliases: {aliases}.", "model", 404)
    return name


async def open_request(request: Request, served: Served, allowed: set[str]) -> tuple[Body, str]:
    """The body (only ``allowed`` fields) and the model name it asks for."""
    body = await read(request)
    check_fields(body, allowed)
    return body, model_of(body, served)


@dataclass
class StreamFlags:
    stream: bool
    include_usage: bool
    continuous: bool  # usage in every chunk
    interval: int  # tokens between chunks


def stream_flags(body: Body) -> StreamFlags:
    stream = body.boolean("stream", False)
    options = body.data.get("stream_options")
    if options is not None and not stream:
        raise OpenAIError("Stream options can only be defined when `stream=True`.", "stream_options")
    if options is not None and not isinstance(options, dict):
        raise OpenAIError("stream_options must be an object", "stream_options")
    opts = Body(options or {})
    interval = body.integer("stream_interval", 1, 1)
    assert interval is not None
    return StreamFlags(
        stream,
        opts.boolean("include_usage", False),
        opts.boolean("continuous_usage_stats", False),
        interval,
    )


def no_prompt_logprobs_in_stream(body: Body, stream: bool) -> None:
    if stream and body.data.get("prompt_logprobs") is not None:
        raise OpenAIError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


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


@dataclass
class Reply:
    """A request being answered: its body, the engine's job, the answer's id and model name."""

    body: Body
    job: Job
    rid: str
    model: str


def shown_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """``usage`` without its empty fields (what vLLM's stream chunks carry)."""
    return {k: v for k, v in usage(prompt_tokens, completion_tokens).items() if v is not None}


def shown_prompt(ids: list[int], prompt_text: str | None, with_ids: bool, t: Text) -> str:
    """The prompt an echo shows: its text as given (none with ``return_token_ids``)."""
    return "" if with_ids else (prompt_text if prompt_text is not None else t.decode(ids))


def should_skip(progress: Any, index: int, started: set[int], s: Streamer, interval: int) -> bool:
    """``stream_interval``: a sample's chunks come every ``interval`` tokens (its first and its last
    always)."""
    return not progress.ended and index in started and progress.tokens - s.tokens < interval


def create_router(served: Served, server_info: bool = True, guard: Sequence[Any] = ()) -> APIRouter:
    """The generation routes; ``server_info``: also ``GET /server_info`` (``loom engine`` has it only
    in vLLM's dev mode, from control.py, as vLLM does), behind ``guard`` (the dependencies of the
    routes that show the configuration: the rollout service's service token)."""
    router = APIRouter(responses=ENGINE_ERRORS)
    completion_routes(router, served)
    chat_routes(router, served)
    trl_routes(router, served, server_info, guard)
    return router


# ------------------------------------------------------------------------------------------------
# completions


def completion_routes(router: APIRouter, served: Served) -> None:
    @router.post("/v1/completions")
    async def completions(request: Request) -> Any:
        try:
            body, model = await open_request(request, served, SAMPLING | COMPLETION_ONLY)
            engine, tokenizer = await served.engine_for(model), await served.tokenizer()
            flags = stream_flags(body)
            job, logprobs, echo_only = completion_job(body, served, engine, tokenizer, flags.stream)
            reply = Reply(body, job, request_id(body, "cmpl"), model)
            if flags.stream:
                plps: list[PromptLogprobs | None] = [None] * len(job.prompts)
                if job.prompt_k is not None:  # echo with log-probs: the first chunk carries the prompt's
                    plps = list(
                        await asyncio.gather(
                            *(engine.prompt_logprobs(ids, job.prompt_k) for ids, _ in job.prompts)
                        )
                    )
                events = await first_then_rest(merged(engine, job))
                lines = stream_completion(reply, events, plps, flags, logprobs)
                return StreamingResponse(lines, media_type="text/event-stream")
            outs, plps = await run(engine, job)
        except (OpenAIError, EngineError, ValueError) as exc:
            return failure(exc)
        return JSONResponse(completion_answer(reply, outs, plps, logprobs, echo_only))


def completion_job(
    body: Body, served: Served, engine: Engine, tokenizer: Any, stream: bool
) -> tuple[Job, int | None, bool]:
    """The engine's job for a completion request, its ``logprobs`` and whether it only echoes."""
    logprobs = logprobs_count(body.data.get("logprobs"), "logprobs", engine.vocab_size)
    prompt_k = logprobs_count(body.data.get("prompt_logprobs"), "prompt_logprobs", engine.vocab_size)
    echo = body.boolean("echo", False)
    if prompt_k is None and echo and logprobs is not None:
        prompt_k = logprobs  # vLLM: echoed prompt tokens get log-probs too
    if prompt_k is not None:
        no_prompt_logprobs_in_stream(body, stream)
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
    return job, logprobs, echo_only


def completion_answer(
    reply: Reply,
    outs: list[list[Completion]],
    plps: list[PromptLogprobs | None],
    logprobs: int | None,
    echo_only: bool,
) -> dict[str, Any]:
    body, job, t = reply.body, reply.job, reply.job.text
    echo, with_ids = body.boolean("echo", False), body.boolean("return_token_ids", False)
    choices: list[dict[str, Any]] = []
    n_prompt = n_out = 0
    cached = 0
    for (ids, prompt_text), params, samples, plp in zip(job.prompts, job.params, outs, plps, strict=True):
        n_prompt += len(ids)
        shown = shown_prompt(ids, prompt_text, with_ids, t)
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
                out_text = shown + out_text
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
        "id": reply.rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": reply.model,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage(n_prompt, n_out, cached),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


async def stream_completion(
    reply: Reply,
    events: AsyncIterator[tuple[int, Any]],
    plps: list[PromptLogprobs | None],
    flags: StreamFlags,
    logprobs: int | None,
) -> AsyncIterator[str]:
    chunks = CompletionChunks(reply, plps, flags, logprobs)
    try:
        async for i, progress in events:
            chunk = chunks.of(i, progress)
            if chunk is not None:
                yield sse(chunk)
        if flags.include_usage:
            yield sse(chunks.usage())
    except Exception as exc:  # after the 200 has gone out: vLLM's in-stream error
        yield sse(engine_error(exc).body())
    yield sse("[DONE]")


class CompletionChunks:
    """The chunks of a streamed completion: every sample's text deltas (prompt index i, sample j is
    choice ``i * n + j``), the echoed prompt in a choice's first chunk."""

    def __init__(
        self, reply: Reply, plps: list[PromptLogprobs | None], flags: StreamFlags, logprobs: int | None
    ) -> None:
        self.reply, self.plps, self.flags, self.logprobs = reply, plps, flags, logprobs
        body, job = reply.body, reply.job
        self.echo, self.with_ids = body.boolean("echo", False), body.boolean("return_token_ids", False)
        self.n = job.params[0].n
        self.created = int(time.time())
        self.streamers: dict[int, Streamer] = {}
        self.started: set[int] = set()
        self.sent_tokens = dict.fromkeys(range(len(job.prompts) * self.n), 0)

    def of(self, i: int, progress: Any) -> dict[str, Any] | None:
        """The chunk of prompt ``i``'s progress event (None: within ``stream_interval``)."""
        job, t, logprobs = self.reply.job, self.reply.job.text, self.logprobs
        index = i * self.n + progress.sample
        s = self.streamers.setdefault(index, Streamer(job, job.params[i]))
        c = progress.completion
        if should_skip(progress, index, self.started, s, self.flags.interval):
            return None
        new, delta = s.advance(c, progress.tokens, progress.ended)
        start = len(c.token_ids[: progress.tokens]) - len(new)
        ids, prompt_text = job.prompts[i]
        lp_ids: list[int] = list(new)
        lps: list[float | None] = list(c.logprobs[start : progress.tokens])
        tops: list[list[tuple[int, float]] | None] = list(
            sample_entries(c, logprobs or 0, start, progress.tokens)
        )
        first = index not in self.started
        if first and self.echo:
            delta = shown_prompt(ids, prompt_text, self.with_ids, t) + delta
            plp = self.plps[i]
            if logprobs is not None and plp is not None:
                lp_ids, lps, tops = with_prompt(ids, plp, logprobs, lp_ids, lps, tops)
        self.started.add(index)
        chunk_lp = None
        if logprobs is not None:
            chunk_lp = completion_logprobs(lp_ids, lps, tops, t, s.offset)
            s.offset += sum(len(x) for x in chunk_lp["tokens"])
        self.sent_tokens[index] = progress.tokens
        choice = {
            "index": index,
            "text": delta,
            "logprobs": chunk_lp,
            "finish_reason": c.finish_reason if progress.ended else None,
            "stop_reason": c.stop_reason if progress.ended else None,
            "prompt_token_ids": list(ids) if first and (self.echo or self.with_ids) else None,
            "token_ids": list(new) if self.with_ids else None,
        }
        chunk: dict[str, Any] = {**self.head(), "choices": [choice]}
        if self.flags.continuous:
            chunk["usage"] = shown_usage(len(ids), progress.tokens)
        return chunk

    def head(self) -> dict[str, Any]:
        return {
            "id": self.reply.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.reply.model,
        }

    def usage(self) -> dict[str, Any]:
        """The last chunk (``include_usage``): every prompt's tokens and every token sent."""
        prompt_tokens = sum(len(ids) for ids, _ in self.reply.job.prompts)
        final = shown_usage(prompt_tokens, sum(self.sent_tokens.values()))
        return {**self.head(), "choices": [], "usage": final, "system_fingerprint": FINGERPRINT}


# ------------------------------------------------------------------------------------------------
# chat


def chat_routes(router: APIRouter, served: Served) -> None:
    @router.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body, model = await open_request(request, served, SAMPLING | CHAT_ONLY)
            engine, tokenizer = await served.engine_for(model), await served.tokenizer()
            flags = stream_flags(body)
            no_prompt_logprobs_in_stream(body, flags.stream)
            job, (conv,), k = await chat_job(body, [body.data.get("messages")], served, engine, tokenizer)
            reply = Reply(body, job, request_id(body, "chatcmpl"), model)
            if flags.stream:
                events = await first_then_rest(merged(engine, job))
                return StreamingResponse(
                    stream_chat(reply, conv, events, flags, k), media_type="text/event-stream"
                )
            (samples,), (plp,) = await run(engine, job)
        except (OpenAIError, EngineError, ValueError) as exc:
            return failure(exc)
        ids, rendered = job.prompts[0]
        choices = [chat_choice(body, conv, c, job.params[0], job, k, i) for i, c in enumerate(samples)]
        extra = {
            "prompt_logprobs": prompt_logprobs_field(plp, job.text),
            "prompt_token_ids": list(ids) if body.boolean("return_token_ids", False) else None,
            "prompt_text": rendered if body.boolean("return_prompt_text", False) else None,
        }
        n_out = sum(len(c.token_ids) for c in samples)
        return JSONResponse(chat_answer(reply, choices, len(ids), n_out, extra))

    @router.post("/v1/chat/completions/batch")
    async def chat_batch(request: Request) -> Any:
        """Several conversations in one request, one choice each (vLLM: no n > 1, no streaming, no tools)."""
        try:
            body, model = await open_request(request, served, SAMPLING | CHAT_ONLY)
            conversations = batch_conversations(body)
            engine, tokenizer = await served.engine_for(model), await served.tokenizer()
            job, convs, k = await chat_job(body, conversations, served, engine, tokenizer)
            reply = Reply(body, job, request_id(body, "chatcmpl"), model)
            outs, _ = await run(engine, job)
        except (OpenAIError, EngineError, ValueError) as exc:
            return failure(exc)
        choices = [
            chat_choice(body, conv, samples[0], params, job, k, i)
            for i, (conv, samples, params) in enumerate(zip(convs, outs, job.params, strict=True))
        ]
        n_prompt = sum(len(ids) for ids, _ in job.prompts)
        n_out = sum(len(c.token_ids) for samples in outs for c in samples)
        return JSONResponse(chat_answer(reply, choices, n_prompt, n_out, {}))


def batch_conversations(body: Body) -> list[Any]:
    """The conversations of a batch chat request (vLLM: no n > 1, no streaming, no tools)."""
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
    return conversations


async def chat_job(
    body: Body, conversations: list[Any], served: Served, engine: Engine, tokenizer: Any
) -> tuple[Job, list[list[dict[str, Any]]], int]:
    """The engine's job for chat conversations, the conversations read, and the top log-probs asked."""
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
        key = "max_completion_tokens" if body.data.get("max_completion_tokens") is not None else "max_tokens"
        requested = body.integer(key, served.defaults.get("max_tokens"), 1)
        limit = max_tokens_for(requested, len(ids), engine.max_model_len, key)
        convs.append(conv)
        prompts.append((ids, rendered))
        params.append(sampling(body, served.defaults, limit, k, engine.vocab_size))
    job = Job(prompts, params, text, body.boolean("include_stop_str_in_output", False), prompt_k)
    return job, convs, k


def reply_role(body: Body, conv: list[dict[str, Any]]) -> str:
    return "assistant" if body.boolean("add_generation_prompt", True) else conv[-1]["role"]


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
    role = reply_role(body, conv)
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
    reply: Reply, choices: list[dict[str, Any]], n_prompt: int, n_out: int, extra: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": reply.rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model,
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


async def stream_chat(
    reply: Reply,
    conv: list[dict[str, Any]],
    events: AsyncIterator[tuple[int, Any]],
    flags: StreamFlags,
    k: int,
) -> AsyncIterator[str]:
    chunks = ChatChunks(reply, conv, flags, k)
    try:
        for line in chunks.openings():
            yield line
        async for _, progress in events:
            chunk = chunks.of(progress)
            if chunk is not None:
                yield chunk
        if flags.include_usage:
            yield chunks.usage()
    except Exception as exc:  # after the 200 has gone out: vLLM's in-stream error
        yield sse(engine_error(exc).body())
    yield sse("[DONE]")


class ChatChunks:
    """The chunks of a streamed chat answer: every choice opens with the role (and the echoed last
    message), then its text deltas."""

    def __init__(self, reply: Reply, conv: list[dict[str, Any]], flags: StreamFlags, k: int) -> None:
        self.reply, self.conv, self.flags, self.k = reply, conv, flags, k
        self.created = int(time.time())
        self.ids, _ = reply.job.prompts[0]
        self.params = reply.job.params[0]
        self.with_ids = reply.body.boolean("return_token_ids", False)
        self.role = reply_role(reply.body, conv)
        self.streamers: dict[int, Streamer] = {}
        self.started: set[int] = set()
        self.sent_tokens = dict.fromkeys(range(self.params.n), 0)

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        head = {"id": self.reply.rid, "object": "chat.completion.chunk", "created": self.created}
        return sse({**head, "model": self.reply.model, "choices": choices, **extra})

    def counts(self, index: int) -> dict[str, Any]:
        if not self.flags.continuous:
            return {}
        return {"usage": shown_usage(len(self.ids), self.sent_tokens[index])}

    def openings(self) -> Iterator[str]:
        """vLLM opens every choice with the role (and, with ``echo``, the last message's content)."""
        conv = self.conv
        for index in range(self.params.n):
            first = {
                "index": index,
                "delta": {"role": self.role, "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            prompt_ids = list(self.ids) if self.with_ids else None
            yield self.chunk([first], prompt_token_ids=prompt_ids, prompt_text=None, **self.counts(index))
            if (
                self.reply.body.boolean("echo", False)
                and conv[-1].get("role") == self.role
                and conv[-1]["content"]
            ):
                echoed = {
                    "index": index,
                    "delta": {"content": conv[-1]["content"]},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield self.chunk([echoed], **self.counts(index))

    def of(self, progress: Any) -> str | None:
        """The chunk of a progress event (None: within ``stream_interval``)."""
        index, job, k = progress.sample, self.reply.job, self.k
        s = self.streamers.setdefault(index, Streamer(job, self.params))
        if should_skip(progress, index, self.started, s, self.flags.interval):
            return None
        self.started.add(index)
        c = progress.completion
        new, delta = s.advance(c, progress.tokens, progress.ended)
        start = progress.tokens - len(new)
        self.sent_tokens[index] = progress.tokens
        lp = None
        if self.reply.body.boolean("logprobs", False):
            entries = sample_entries(c, k, start, progress.tokens)
            lp = chat_logprobs(new, c.logprobs[start : progress.tokens], entries, k, job.text)
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"content": delta},
            "logprobs": lp,
            "finish_reason": c.finish_reason if progress.ended else None,
        }
        if progress.ended:
            choice["stop_reason"] = c.stop_reason
        choice["token_ids"] = list(new) if self.with_ids else None
        return self.chunk([choice], **self.counts(index))

    def usage(self) -> str:
        u = shown_usage(len(self.ids), sum(self.sent_tokens.values()))
        return self.chunk([], usage=u, system_fingerprint=FINGERPRINT)


# ------------------------------------------------------------------------------------------------
# TRL's routes


def trl_routes(router: APIRouter, served: Served, server_info: bool, guard: Sequence[Any] = ()) -> None:
    """``/server_info`` (unless control.py serves it; behind ``guard``), ``/get_world_size``, and the
    NCCL weight-transfer routes, refused with 501."""
    if server_info:

        @router.get("/server_info", dependencies=list(guard), responses=_guarded(guard))
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


def _guarded(guard: Sequence[Any]) -> dict[int | str, dict[str, Any]]:
    return dict(UNAUTHORIZED) if guard else {}


def basic_routes(router: APIRouter, served: Served, guard: Sequence[Any] = ()) -> None:
    """``/health``, ``/v1/models`` and ``/reset_prefix_cache`` (TRL calls it after a weight sync; it
    changes the engine's state: behind ``guard``) for a mount that has none of its own (the rollout
    service)."""

    @router.post("/reset_prefix_cache", dependencies=list(guard), responses=_guarded(guard))
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


def engine_router(
    engine: Engine,
    model_name: str,
    tokenizer: Any,
    names: set[str],
    adapters: dict[str, Engine] | None = None,
) -> APIRouter:
    """The routes over one engine built already (``loom engine``); ``names`` and ``adapters`` (each
    runtime LoRA adapter's engine, by its served name) grow and shrink as adapters are loaded."""
    path = getattr(engine, "model_path", None)

    async def get_engine() -> Engine:
        return engine

    async def get_tokenizer() -> Any:
        return tokenizer

    model_path = None if path is None else str(path)
    return create_router(
        Served(
            get_engine,
            get_tokenizer,
            model_name,
            names,
            model_path,
            generation_defaults(path),
            {} if adapters is None else adapters,
        ),
        server_info=False,
    )
