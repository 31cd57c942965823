"""The vllm engine: a client of a vLLM OpenAI-compatible server (pinned: vLLM 0.11.0).

Protocol (vllm/entrypoints/openai/protocol.py and api_server.py of v0.11.0):
- ``POST /v1/completions`` with ``prompt`` as a list of token ids, ``n``, ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``logprobs`` (top-k;
  0 = the sampled token only), ``return_token_ids`` (>= 0.10.2: each choice carries ``token_ids`` and
  ``prompt_token_ids``) and ``return_tokens_as_token_ids`` (top-k keys read ``token_id:<id>``).
  Each choice has ``logprobs.token_logprobs``, ``finish_reason`` and ``stop_reason`` (stop string or
  stop token id; null for EOS). Log-probs are raw unless the server runs ``--logprobs-mode``.
- Control plane: ``POST /v1/load_lora_adapter {lora_name, lora_path, load_inplace}`` (needs
  ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``); with ``VLLM_SERVER_DEV_MODE=1``:
  ``POST /collective_rpc {method, args, kwargs, timeout}`` (Loom's worker extension
  ``rollout_svc.engines.vllm_worker.LoomWorkerExtension`` adds ``loom_reload_weights(path)``) and
  ``POST /reset_prefix_cache``. ``loom engine`` serves the same routes.

No custom position ids or attention masks: a ``Layout`` is refused with ``UnsupportedCapability``.
Connection errors and 5xx are retried with exponential backoff; every request has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from loom.schemas import PolicyVersion, SamplingParams
from rollout_svc.engines.base import (
    Completion,
    Engine,
    EngineRequestError,
    EngineTimeout,
    EngineUnavailable,
    Layout,
    UnsupportedCapability,
)

log = logging.getLogger("loom.rollout.vllm")

VLLM_VERSION = "0.11.0"
RELOAD_METHOD = "loom_reload_weights"


def completion_body(model: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "n": params.n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "seed": params.seed,
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "logprobs": params.logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if params.top_k > 0:
        body["top_k"] = params.top_k
    # the logits processors, under vLLM's own names, only where set (their defaults are vLLM's)
    defaults = SamplingParams()
    for name in PROCESSOR_FIELDS:
        if getattr(params, name) != getattr(defaults, name):
            body[name] = getattr(params, name)
    return body


PROCESSOR_FIELDS = (
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "allowed_token_ids",
)


def parse_choice(choice: dict[str, Any]) -> Completion:
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise EngineRequestError("server returned no token_ids: it needs vLLM >= 0.10.2 (return_token_ids)")
    lp = choice.get("logprobs") or {}
    token_lps = lp.get("token_logprobs")
    if token_lps is None or len(token_lps) != len(token_ids):
        raise EngineRequestError("server returned no per-token log-probs for every token")
    top = None
    if lp.get("top_logprobs") is not None:
        top = [
            {int(k.removeprefix("token_id:")): float(v) for k, v in (d or {}).items()}
            for d in lp["top_logprobs"]
        ]
    finish = choice.get("finish_reason") or "stop"
    return Completion(
        token_ids=[int(t) for t in token_ids],
        logprobs=[float(x) if x is not None else 0.0 for x in token_lps],
        finish_reason="length" if finish == "length" else "stop",
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
    )


class VLLMEngine(Engine):
    name = "vllm"
    capabilities = frozenset({"prefix_cache", "lora"})

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        backoff: float = 0.2,
        api_key: str | None = None,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retries = retries
        self.backoff = backoff
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            headers=headers,
        )

    async def _request(self, method: str, path: str, json: Any = None, timeout: float | None = None) -> Any:
        delay = self.backoff
        for attempt in range(self.retries + 1):
            last: str
            try:
                kwargs: dict[str, Any] = {"json": json}
                if timeout is not None:
                    kwargs["timeout"] = timeout
                r = await self.http.request(method, path, **kwargs)
            except httpx.TimeoutException as exc:
                raise EngineTimeout(f"{method} {self.base_url}{path} timed out: {exc!r}") from exc
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
            else:
                if r.status_code < 400:
                    return r.json() if r.content else None
                if r.status_code < 500:
                    raise EngineRequestError(f"{method} {path} -> HTTP {r.status_code}: {r.text[:500]}")
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            if attempt < self.retries:
                log.warning(
                    "engine %s%s failed (%s); retry %d in %.2fs",
                    self.base_url,
                    path,
                    last,
                    attempt + 1,
                    delay,
                )
                await asyncio.sleep(delay)
                delay *= 2
        raise EngineUnavailable(
            f"{method} {self.base_url}{path} failed after {self.retries + 1} tries: {last}"
        )

    async def model_name(self) -> str:
        if self.model is None:
            models = await self._request("GET", "/v1/models")
            self.model = str(models["data"][0]["id"])
        return self.model

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        if layout is not None:
            raise UnsupportedCapability(
                self.name, "group_positions", "vLLM has no custom position ids; use the interleaved layout"
            )
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        body = completion_body(await self.model_name(), prompt_ids, params)
        resp = await self._request("POST", "/v1/completions", json=body)
        choices = sorted(resp["choices"], key=lambda c: c["index"])
        if len(choices) != params.n:
            raise EngineRequestError(f"asked for {params.n} samples, server returned {len(choices)}")
        usage = resp.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0)
        self.stats.requests += 1
        self.stats.cached_tokens += cached
        self.stats.prefill_tokens += len(prompt_ids) - cached
        out = [parse_choice(c) for c in choices]
        self.stats.decode_tokens += sum(len(c.token_ids) for c in out)
        return out

    async def load_policy(self, policy: PolicyVersion) -> None:
        if policy.kind == "lora":
            name = f"loom-policy-v{policy.version}"
            await self._request(
                "POST",
                "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": policy.path, "load_inplace": True},
            )
            self.model = name
        else:
            await self._request(
                "POST",
                "/collective_rpc",
                json={"method": RELOAD_METHOD, "args": [policy.path], "kwargs": {}, "timeout": 600},
                timeout=660.0,
            )
        await self.reset_cache()
        self.policy_version = policy.version

    async def reset_cache(self) -> None:
        await self._request("POST", "/reset_prefix_cache")

    async def health(self) -> bool:
        try:
            r = await self.http.get("/health", timeout=5.0)
            return r.status_code == 200
        except httpx.HTTPError:
            return False

    async def close(self) -> None:
        await self.http.aclose()
