"""vLLM 0.32's OpenAI protocol, read and written without a server: what openai_api.py's routes parse
and answer (docs/interop-engine.md).

Requests are read field by field with vLLM's checks and its words (``Body``, ``sampling``): every
field of vLLM's request models is honoured (``SAMPLING``, ``COMPLETION_ONLY``, ``CHAT_ONLY``), has no
effect on vLLM either (``NO_EFFECT``) or is refused with a 400 naming it (``REFUSED``). Answers are
written in vLLM's shapes: text cut at stop strings as vLLM cuts it (``final_text``), log-probs as
vLLM lists them (the sampled token first, then by rank), prompts through the chat template.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Completion, EngineError, InvalidPrompt, PromptLogprobs

log = logging.getLogger("loom.engine.openai")

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
MAX_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a lower temperature is greedy
FINGERPRINT = "loom-engine"

# The fields of vLLM 0.32's request models and what loom engine does with each
# (vllm/entrypoints/openai/completion/protocol.py, chat_completion/protocol.py).
SAMPLING = {
    "n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "ignore_eos",
    "logit_bias", "allowed_token_ids", "logprobs", "prompt_logprobs", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "stream", "stream_options", "stream_interval", "echo", "return_token_ids",
    "return_tokens_as_token_ids", "add_special_tokens", "model",
}  # fmt: skip
COMPLETION_ONLY = {"prompt"}
CHAT_ONLY = {
    "messages", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
    "continue_final_message", "documents", "chat_template", "chat_template_kwargs", "tools",
    "tool_choice", "parallel_tool_calls", "reasoning_effort", "include_reasoning", "return_prompt_text",
}  # fmt: skip
# accepted: they change no output on vLLM either (metadata; render-route-only options)
NO_EFFECT = {"user", "request_id", "session_id", "return_token_offsets", "mm_payload", "return_mm_kwargs"}
# refused unless left at the value here (vLLM features loom engine does not implement)
REFUSED: dict[str, tuple[Any, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),  # beam search only
    "early_stopping": (False,),  # beam search only
    "best_of": (1,),
    "watermarking": (False,),
    "bad_words": ([],),
    "logprob_token_ids": ([],),
    "structured_outputs": (),
    "guided_decoding_backend": (),
    "response_format": ({"type": "text"},),
    "suffix": (),
    "prompt_embeds": (),
    "priority": (0,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "ec_transfer_params": (),
    "vllm_xargs": (),
    "repetition_detection": (),
    "thinking_token_budget": (-1,),
    "routed_experts_prompt_start": (0,),
    "media_io_kwargs": ({},),
    "mm_processor_kwargs": ({},),
}
GENERATION_DEFAULTS = (  # what vLLM reads from generation_config.json (ModelConfig.get_diff_sampling_param)
    "repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p", "min_p",
)  # fmt: skip


class OpenAIError(Exception):
    """An answer in vLLM's ErrorResponse shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    @property
    def kind(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError", 501: "NotImplementedError"}.get(
            self.status, "InternalServerError"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }


def generation_defaults(model_path: str | Path | None) -> dict[str, Any]:
    """The model's sampling defaults from its generation_config.json, as vLLM reads them
    (``--generation-config auto``): only values set there and different from transformers' defaults."""
    if model_path is None or not (Path(model_path) / "generation_config.json").exists():
        return {}
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(str(model_path)).to_diff_dict()
    except (OSError, ValueError):
        return {}
    out = {k: config[k] for k in GENERATION_DEFAULTS if config.get(k) is not None}
    if config.get("max_new_tokens") is not None:
        out["max_tokens"] = config["max_new_tokens"]
    return out


# ------------------------------------------------------------------------------------------------
# reading a request


class Body:
    """A request's JSON object, read field by field with vLLM's checks (400 naming the field)."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise OpenAIError(f"{key} must be a boolean, got {value!r}", key)
        return value

    def integer(self, key: str, default: int | None, minimum: int | None = None) -> int | None:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise OpenAIError(f"{key} must be an integer, got {value!r}", key)
        if minimum is not None and value < minimum:
            raise OpenAIError(f"{key} must be at least {minimum}, got {value}.", key)
        return value

    def number(self, key: str, default: float) -> float:
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise OpenAIError(f"{key} must be a finite number, got {value!r}", key)
        return float(value)

    def integers(self, key: str) -> list[int] | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
            raise OpenAIError(f"{key} must be a list of integers, got {value!r}", key)
        return list(value)


def check_fields(body: Body, route_fields: set[str]) -> None:
    """400 for a vLLM feature loom engine does not implement; a warning for an unknown field."""
    for key, value in body.data.items():
        if key in REFUSED:
            if value is None or value in REFUSED[key]:
                continue
            raise OpenAIError(
                f"{key}={json.dumps(value)[:80]} is not supported by loom engine (docs/interop-engine.md)",
                key,
            )
        if key not in route_fields and key not in NO_EFFECT:
            log.warning("the request's field %r is not a vLLM field; ignored (as vLLM ignores it)", key)


def sampling(
    body: Body, defaults: dict[str, Any], max_tokens: int, logprobs: int, vocab_size: int | None
) -> SamplingParams:
    """``SamplingParams`` from the request, with vLLM's validation and its defaults (the request's
    value, else the model's generation_config.json (``defaults``), else OpenAI's)."""
    temperature, top_p, top_k, min_p = _truncation(body, defaults)
    repetition, presence, frequency = _penalties(body, defaults)
    n = body.integer("n", 1, 1)
    assert n is not None
    greedy = temperature < GREEDY_EPS
    if greedy and n > 1:
        raise OpenAIError(f"n must be 1 when using greedy sampling, got {n}.", "n")
    min_tokens = body.integer("min_tokens", 0, 0)
    assert min_tokens is not None
    if min_tokens > max_tokens:
        raise OpenAIError(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )
    seed = body.integer("seed", None)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise OpenAIError("seed must be a 64-bit integer", "seed")
    stops = _stop_strings(body)
    bias = _logit_bias(body, vocab_size)
    allowed = _allowed_token_ids(body, vocab_size)
    try:
        return SamplingParams(
            n=n,
            max_tokens=max_tokens,
            temperature=0.0 if greedy else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=-1 if greedy or top_k in (0, -1) else top_k,
            min_p=0.0 if greedy else min_p,
            seed=None if seed == -1 else seed,
            stop=stops,
            stop_token_ids=list(dict.fromkeys(body.integers("stop_token_ids") or [])),
            logprobs=logprobs,
            repetition_penalty=repetition,
            presence_penalty=presence,
            frequency_penalty=frequency,
            min_tokens=min_tokens,
            ignore_eos=body.boolean("ignore_eos", False),
            logit_bias=bias,
            allowed_token_ids=allowed,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise OpenAIError(f"{where}: {err['msg']}", where) from None


def _truncation(body: Body, d: dict[str, Any]) -> tuple[float, float, int, float]:
    """temperature, top_p, top_k and min_p, checked as vLLM checks them."""
    temperature = body.number("temperature", d.get("temperature", 1.0))
    if temperature < 0 or temperature > 2:
        raise OpenAIError(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    top_p = body.number("top_p", d.get("top_p", 1.0))
    if not 0 < top_p <= 1:
        raise OpenAIError(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = body.integer("top_k", d.get("top_k", 0))
    assert top_k is not None
    if top_k < -1:
        raise OpenAIError(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = body.number("min_p", d.get("min_p", 0.0))
    if not 0 <= min_p <= 1:
        raise OpenAIError(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    return temperature, top_p, top_k, min_p


def _penalties(body: Body, d: dict[str, Any]) -> tuple[float, float, float]:
    """The repetition, presence and frequency penalties, checked as vLLM checks them."""
    repetition = body.number("repetition_penalty", d.get("repetition_penalty", 1.0))
    if repetition <= 0:
        raise OpenAIError(
            f"repetition_penalty must be greater than zero, got {repetition}.", "repetition_penalty"
        )
    presence = body.number("presence_penalty", d.get("presence_penalty", 0.0))
    frequency = body.number("frequency_penalty", d.get("frequency_penalty", 0.0))
    for key, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -2 <= value <= 2:
            raise OpenAIError(f"{key} must be in [-2, 2], got {value}.", key)
    return repetition, presence, frequency


def _stop_strings(body: Body) -> list[str]:
    stop = body.data.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise OpenAIError(f"stop must be a string or a list of strings, got {stop!r}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError(f"stop holds at most {MAX_STOP_STRINGS} strings (VLLM_MAX_STOP_STRINGS)", "stop")
    if any(not s for s in stops):
        raise OpenAIError("stop cannot contain an empty string.", "stop")
    return stops


def _logit_bias(body: Body, vocab_size: int | None) -> dict[int, float]:
    """token id -> bias, clamped to [-100, 100] as vLLM clamps it."""
    bias: dict[int, float] = {}
    raw_bias = body.data.get("logit_bias")
    if raw_bias is None:
        return bias
    if not isinstance(raw_bias, dict):
        raise OpenAIError("logit_bias must be an object of token id -> bias", "logit_bias")
    for k, v in raw_bias.items():
        try:
            tid = int(k)
        except ValueError:
            raise OpenAIError(
                f"logit_bias contains key(s) that cannot be converted to integers: {k!r}", "logit_bias"
            ) from None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise OpenAIError(f"logit_bias values must be numbers, got {v!r}", "logit_bias")
        bias[tid] = min(100.0, max(-100.0, float(v)))
    if vocab_size is not None and (bad := [t for t in bias if not 0 <= t < vocab_size]):
        raise OpenAIError(
            f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
            "logit_bias",
        )
    return bias


def _allowed_token_ids(body: Body, vocab_size: int | None) -> list[int] | None:
    allowed = body.integers("allowed_token_ids")
    if allowed is not None:
        if not allowed:
            raise OpenAIError("allowed_token_ids is not None and empty!", "allowed_token_ids")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in allowed):
            raise OpenAIError("allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
    return allowed


def logprobs_count(value: Any, key: str, vocab_size: int | None) -> int | None:
    """A log-prob count as vLLM checks it: an integer, -1 (the whole vocabulary), at most 20."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise OpenAIError(f"`{key}` must be an integer.", key)
    if value < -1:
        raise OpenAIError(f"`{key}` must be a positive value or -1.", key)
    asked = vocab_size if value == -1 and vocab_size is not None else value
    if asked > MAX_LOGPROBS or value == -1:
        kind, param = ("prompt", key) if key == "prompt_logprobs" else ("sample", "logprobs")
        raise OpenAIError(
            f"Requested {kind} logprobs of {asked}, which is greater than max allowed: {MAX_LOGPROBS}", param
        )
    return value


# ------------------------------------------------------------------------------------------------
# text


@dataclass
class Text:
    """The tokenizer's side of an answer: token strings as vLLM writes them, the visible text."""

    tokenizer: Any
    as_ids: bool = False
    skip_special: bool = True
    spaces_between_special: bool = True

    def token(self, tid: int) -> str:
        """A token as vLLM names it in log-probs: ``token_id:N`` or the token decoded alone (with
        the leading space a SentencePiece piece's marker stands for, which decode() strips)."""
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{tid}"
        text = self.tokenizer.decode([tid]) or ""
        raw = self.tokenizer.convert_ids_to_tokens(tid)
        if isinstance(raw, str) and raw.startswith("\u2581"):
            missing = len(raw) - len(raw.lstrip("\u2581")) - (len(text) - len(text.lstrip(" ")))
            text = " " * missing + text if missing > 0 else text
        return text

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(
            self.tokenizer.decode(
                ids,
                skip_special_tokens=self.skip_special,
                spaces_between_special_tokens=self.spaces_between_special,
            )
        )


def final_text(c: Completion, params: SamplingParams, include_stop: bool, t: Text) -> str:
    """A finished sample's text as vLLM returns it. Ended by EOS or a stop token id: without that
    token's text. Ended by a stop string: cut there (at its first occurrence after token
    ``min_tokens``, before which vLLM does not look). ``include_stop_str_in_output`` keeps either."""
    ids = c.token_ids
    if c.finish_reason == "stop" and not isinstance(c.stop_reason, str) and not include_stop:
        ids = ids[:-1]
    text = t.decode(ids)
    if isinstance(c.stop_reason, str):
        start = len(t.decode(ids[: params.min_tokens])) if params.min_tokens else 0
        at = text.find(c.stop_reason, start)
        if at >= 0:
            return text[: at + (len(c.stop_reason) if include_stop else 0)]
    return text


def running_text(text: str, params: SamplingParams, include_stop: bool) -> str:
    """A running sample's text so far, less the last (longest stop string - 1) characters: they may
    begin a stop string (vLLM's output_text_buffer_length)."""
    if params.stop and not include_stop:
        hold = max(len(s) for s in params.stop) - 1
        return text[: len(text) - hold] if hold else text
    return text


def _lp(value: float) -> float:
    return max(value, -9999.0)  # vLLM's stand-in for -inf (JSON has none)


def top_entries(tid: int, lp: float, top: dict[int, float] | None, k: int) -> list[tuple[int, float]]:
    """vLLM's per-token log-prob entries: the sampled token first, then the others by rank, k + 1 at
    most (k when the sampled token is among the top k)."""
    entries = [(tid, lp)]
    if top:
        entries += sorted(((i, v) for i, v in top.items() if i != tid), key=lambda e: -e[1])[:k]
    return entries


def completion_logprobs(
    ids: list[int],
    lps: list[float | None],
    tops: list[list[tuple[int, float]] | None],
    t: Text,
    offset: int = 0,
) -> dict[str, Any]:
    """vLLM's CompletionLogProbs: ``text_offset`` counts the characters of the token strings."""
    tokens = [t.token(i) for i in ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "text_offset": offsets,
        "token_logprobs": [None if v is None else _lp(v) for v in lps],
        "tokens": tokens,
        "top_logprobs": [None if e is None else {t.token(i): _lp(v) for i, v in e} for e in tops],
    }


def chat_logprobs(
    ids: list[int], lps: list[float], tops: list[list[tuple[int, float]]], k: int, t: Text
) -> dict[str, Any]:
    """vLLM's chat log-probs: ``bytes`` of the decoded token, ``top_logprobs`` the first k entries."""
    plain = Text(t.tokenizer)
    content = []
    for tid, lp, entries in zip(ids, lps, tops, strict=True):
        content.append(
            {
                "token": t.token(tid),
                "logprob": _lp(lp),
                "bytes": list(plain.token(tid).encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": (s := t.token(i)),
                        "logprob": _lp(v),
                        "bytes": list(s.encode("utf-8", errors="replace")),
                    }
                    for i, v in entries[:k]
                ],
            }
        )
    return {"content": content}


def sample_entries(
    c: Completion, k: int, start: int = 0, end: int | None = None
) -> list[list[tuple[int, float]]]:
    end = len(c.token_ids) if end is None else end
    out = []
    for j in range(start, end):
        top = c.top_logprobs[j] if c.top_logprobs is not None and j < len(c.top_logprobs) else None
        out.append(top_entries(c.token_ids[j], c.logprobs[j], top, k))
    return out


def prompt_entries(plps: PromptLogprobs, k: int) -> list[list[tuple[int, float]] | None]:
    """The prompt's positions as log-prob entries (the first has none)."""
    out: list[list[tuple[int, float]] | None] = []
    for d in plps:
        if d is None:
            out.append(None)
            continue
        (tid, (lp, _)), *rest = d.items()
        out.append([(tid, lp), *[(i, v) for i, (v, _) in sorted(rest, key=lambda e: e[1][1])][:k]])
    return out


def with_prompt(
    ids: list[int],
    plp: PromptLogprobs,
    k: int,
    lp_ids: list[int],
    lps: list[float | None],
    tops: list[list[tuple[int, float]] | None],
) -> tuple[list[int], list[float | None], list[list[tuple[int, float]] | None]]:
    """An echoed prompt's tokens in front of the sample's, with their log-prob entries (vLLM)."""
    pe = prompt_entries(plp, k)
    return list(ids) + lp_ids, [None if e is None else e[0][1] for e in pe] + lps, pe + tops


def prompt_logprobs_field(plps: PromptLogprobs | None, t: Text) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per position ``{token id: {logprob, rank, decoded_token}}``."""
    if plps is None:
        return None
    plain = Text(t.tokenizer)
    return [
        None
        if d is None
        else {
            str(i): {"logprob": _lp(v), "rank": r, "decoded_token": plain.token(i)} for i, (v, r) in d.items()
        }
        for d in plps
    ]


# ------------------------------------------------------------------------------------------------
# prompts


def check_ids(ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is not None:
        for tid in ids:
            if not 0 <= tid < vocab_size:
                raise OpenAIError(f"Token id {tid} is out of vocabulary", "prompt")


def completion_prompts(
    body: Body, tokenizer: Any, vocab_size: int | None
) -> list[tuple[list[int], str | None]]:
    """``prompt`` as (token ids, text) per prompt: a string, a list of strings, a list of token ids
    or a list of them (vLLM's forms)."""
    prompt = body.data.get("prompt")
    if prompt is None or prompt == "":
        raise OpenAIError("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        items = [prompt]
    elif isinstance(prompt, list):
        if not prompt:
            raise OpenAIError("You must pass at least one prompt", "prompt")
        items = prompt
    else:
        raise OpenAIError("prompt must be a string, a list of strings or token ids", "prompt")
    if len(items) > MAX_PROMPTS:
        raise OpenAIError(
            f"prompt list length {len(items)} exceeds the maximum allowed count of {MAX_PROMPTS}.", "prompt"
        )
    add_special = body.boolean("add_special_tokens", True)
    out: list[tuple[list[int], str | None]] = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise OpenAIError("text prompts need a tokenizer; this server has none", "prompt")
            out.append((list(tokenizer.encode(item, add_special_tokens=add_special)), item))
        elif isinstance(item, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            out.append((list(item), None))
        else:
            raise OpenAIError("prompt must be a string, a list of strings or token ids", "prompt")
    for ids, _ in out:
        if not ids:
            raise OpenAIError("The decoder prompt cannot be empty", "prompt")
        check_ids(ids, vocab_size)
    return out


def truncate(ids: list[int], body: Body, max_model_len: int | None) -> list[int]:
    """``truncate_prompt_tokens`` (-1: the model's context) from ``truncation_side`` (left: keep the last)."""
    limit = body.integer("truncate_prompt_tokens", None, -1)
    if limit is None:
        return ids
    if limit == -1:
        if max_model_len is None:
            return ids
        limit = max_model_len
    side = body.get("truncation_side", "left")
    if side not in ("left", "right"):
        raise OpenAIError("truncation_side must be 'left' or 'right'", "truncation_side")
    if len(ids) <= limit:
        return ids
    return ids[len(ids) - limit :] if side == "left" else ids[:limit]


def max_tokens_for(requested: int | None, prompt_len: int, max_model_len: int | None, key: str) -> int:
    """vLLM's get_max_tokens: at most the room the context leaves; more than the context is a 400."""
    if max_model_len is not None:
        if prompt_len > max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"contains at least {prompt_len} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )
        if prompt_len == max_model_len:  # no room for one token: vLLM's own words for it
            raise OpenAIError("max_tokens must be at least 1, got 0.", key)
        if requested is not None and requested > max_model_len:
            raise OpenAIError(
                f"{key}={requested} cannot be greater than max_model_len={max_model_len}. "
                "Please request fewer output tokens.",
                key,
            )
        room = max_model_len - prompt_len
        return room if requested is None else min(requested, room)
    if requested is None:
        raise OpenAIError(f"{key} is required: the context length of this engine is unknown", key)
    return requested


# ------------------------------------------------------------------------------------------------
# chat


def conversation(messages: Any, model: str) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template reads them: a list of text parts joined by newlines (vLLM's
    "string" content format), no content read as empty; images and audio are a 400."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise OpenAIError("messages must be a list of message objects", "messages")
    if not messages:
        raise OpenAIError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if not isinstance(role, str):
            raise OpenAIError(f"messages[{i}].role must be a string", f"messages.{i}.role")
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
                elif kind in ("image_url", "input_audio", "audio_url", "video_url", "image", "image_pil"):
                    raise OpenAIError(f"{model} is not a multimodal model", f"messages.{i}.content")
                else:
                    raise OpenAIError(
                        f"messages[{i}].content has a part loom engine cannot read: {part!r}"[:200],
                        f"messages.{i}.content",
                    )
            text = "\n".join(parts)
        else:
            raise OpenAIError(
                f"messages[{i}].content must be a string or a list of parts", f"messages.{i}.content"
            )
        out.append({**{k: v for k, v in m.items() if k != "content"}, "role": role, "content": text})
    return out


def render_chat(body: Body, conv: list[dict[str, Any]], tokenizer: Any) -> tuple[list[int], str]:
    """The prompt the model's chat template makes of ``conv`` (vLLM's keyword arguments to it)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            "the model has no chat template (its tokenizer_config.json or chat_template.jinja): "
            "use /v1/completions"
        )
    if body.data.get("chat_template") is not None:
        raise OpenAIError(
            "Chat template is passed with request, but --trust-request-chat-template is not set. "
            "Refused request with untrusted chat template.",
            "chat_template",
        )
    add_generation = body.boolean("add_generation_prompt", True)
    continue_final = body.boolean("continue_final_message", False)
    if add_generation and continue_final:
        raise OpenAIError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, and "
            "add_generation_prompt when you want to add a header that will prompt it to start a new "
            "assistant message instead."
        )
    kwargs: dict[str, Any] = dict(body.get("chat_template_kwargs", {}))
    if not isinstance(body.get("chat_template_kwargs", {}), dict):
        raise OpenAIError("chat_template_kwargs must be an object", "chat_template_kwargs")
    effort = body.data.get("reasoning_effort")
    if effort is not None:
        kwargs.setdefault("enable_thinking", effort != "none")
    tools = body.data.get("tools")
    if tools:
        if body.get("tool_choice", "auto") != "none":
            raise OpenAIError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                "tool_choice",
            )
    try:
        text = tokenizer.apply_chat_template(
            conv,
            tokenize=False,
            add_generation_prompt=add_generation,
            continue_final_message=continue_final,
            documents=body.data.get("documents"),
            tools=tools or None,
            reasoning_effort=effort,
            **kwargs,
        )
    except Exception as exc:  # a template error (jinja2.TemplateError, ValueError): the request's doing
        raise OpenAIError(f"the chat template could not render these messages: {exc}", "messages") from None
    ids = list(tokenizer.encode(text, add_special_tokens=body.boolean("add_special_tokens", False)))
    if not ids:
        raise OpenAIError("The decoder prompt cannot be empty", "messages")
    return ids, str(text)


# ------------------------------------------------------------------------------------------------
# one generation request, shared by the routes


@dataclass
class Job:
    """What a route asks of the engine: prompts, sampling, what the answer shows."""

    prompts: list[tuple[list[int], str | None]]
    params: list[SamplingParams]  # one per prompt (max_tokens depends on each prompt's length)
    text: Text
    include_stop: bool
    prompt_k: int | None = None  # prompt log-probs asked (or echo with log-probs)


def engine_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidPrompt):
        return OpenAIError(str(exc), exc.field)
    if isinstance(exc, ValueError | EngineError):
        return OpenAIError(str(exc))
    return OpenAIError(f"{type(exc).__name__}: {exc}", status=500)


def usage(prompt_tokens: int, completion_tokens: int, cached: int | None = None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "completion_tokens_details": None,
    }


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class Streamer:
    """Turns one sample's ``Progress`` events into text deltas: incremental decoding (a window of
    recent tokens, holding back an incomplete UTF-8 character), then the stop-string rules of
    ``running_text`` and ``final_text``."""

    def __init__(self, job: Job, params: SamplingParams) -> None:
        self.job, self.params = job, params
        self.tokens = 0  # tokens sent
        self.decoded = ""  # text of the tokens decoded so far
        self.prefix = self.read = 0
        self.sent = ""  # visible text sent
        self.offset = 0  # text_offset of the next token string

    def advance(self, c: Completion, count: int, ended: bool) -> tuple[list[int], str]:
        new = c.token_ids[self.tokens : count]
        t = self.job.text
        if ended:  # the whole text, as the non-streamed answer has it
            shown = final_text(c, self.params, self.job.include_stop, t)
        else:
            before = t.decode(c.token_ids[self.prefix : self.read])
            after = t.decode(c.token_ids[self.prefix : count])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.decoded += after[len(before) :]
                self.prefix, self.read = self.read, count
            shown = running_text(self.decoded, self.params, self.job.include_stop)
        delta = shown[len(self.sent) :] if shown.startswith(self.sent) else ""
        self.sent = shown if shown.startswith(self.sent) else self.sent
        self.tokens = count
        return new, delta
