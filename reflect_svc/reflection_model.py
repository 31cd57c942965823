"""Client of the reflection model: any OpenAI-compatible server (vLLM, ``loom engine``).

One call per trajectory labels every chunk (REA-RL §4.2: one step, concise "[i]. Think/Result").
``/v1/completions`` (the default; ``loom engine`` serves only this one) or ``/v1/chat/completions``,
greedy, with top log-probs. The answer is returned as plain data for ``detectors.detect_model``:
the output text (the concatenation of the output tokens when the server gave them) and, per token,
its top log-probs. Model output is untrusted text: it is only matched with a regular expression.
The server is the operator's (``LOOM_REFLECT_MODEL_URL``; never a request's), and a failed call is a
``ModelError`` naming the status only: what the server said is logged, never returned to a user.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx

from reflect_svc.detectors import token_text

log = logging.getLogger("loom.reflect.model")


class ModelError(RuntimeError):
    """The reflection model could not be reached or answered something that is not a completion."""


@dataclass(frozen=True)
class ModelOutput:
    text: str
    tokens: list[str] | None = None
    tops: list[dict[str, float] | None] | None = None


def parse_completion(body: Any) -> ModelOutput:
    """A ``/v1/completions`` or ``/v1/chat/completions`` response -> ModelOutput."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise ModelError(f"no choices in the response: {type(exc).__name__}") from None
    if not isinstance(choice, dict):
        raise ModelError("choice is not an object")
    if "message" in choice:  # chat
        text = str((choice.get("message") or {}).get("content") or "")
        content = (choice.get("logprobs") or {}).get("content")
        if isinstance(content, list) and content:
            tokens = [str(c.get("token", "")) for c in content]
            tops: list[dict[str, float] | None] = [
                {
                    str(t.get("token", "")): float(t.get("logprob", float("-inf")))
                    for t in c.get("top_logprobs") or []
                }
                or None
                for c in content
            ]
            return ModelOutput("".join(token_text(t) for t in tokens), tokens, tops)
        return ModelOutput(text)
    text = str(choice.get("text") or "")
    lp = choice.get("logprobs") or {}
    tokens_raw, tops_raw = lp.get("tokens"), lp.get("top_logprobs")
    if isinstance(tokens_raw, list) and tokens_raw and isinstance(tops_raw, list):
        tokens = [str(t) for t in tokens_raw]
        tops = [
            {str(k): float(v) for k, v in d.items()} if isinstance(d, dict) and d else None for d in tops_raw
        ]
        return ModelOutput("".join(token_text(t) for t in tokens), tokens, tops)
    return ModelOutput(text)


@dataclass
class ReflectionModel:
    url: str  # server root, e.g. http://127.0.0.1:8000
    model: str = ""
    endpoint: str = "completions"  # or "chat"
    top_logprobs: int = 5
    tokens_per_chunk: int = 10
    timeout_s: float = 120.0

    def label(self, prompt: str, n_chunks: int) -> ModelOutput:
        max_tokens = self.tokens_per_chunk * n_chunks + 16
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0}
        if self.endpoint == "chat":
            path = "/v1/chat/completions"
            body.update(
                messages=[{"role": "user", "content": prompt}], logprobs=True, top_logprobs=self.top_logprobs
            )
        else:
            path = "/v1/completions"
            body.update(prompt=prompt, logprobs=self.top_logprobs)
        try:
            r = httpx.post(self.url.rstrip("/") + path, json=body, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise ModelError(f"the reflection model could not be reached ({type(exc).__name__})") from None
        if r.status_code >= 400:  # its body goes to this service's log, never into a user's error
            log.warning("reflection model answered HTTP %d: %s", r.status_code, r.text[:300])
            raise ModelError(f"the reflection model answered HTTP {r.status_code}")
        try:
            data = r.json()
        except ValueError:
            raise ModelError("response is not JSON") from None
        return parse_completion(data)
