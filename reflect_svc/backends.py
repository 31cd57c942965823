"""The ``Services`` the core needs, over the queues or over HTTP (no service package is imported).

- ``QueueServices``: ``reward.match_texts``, ``rollout.generate_group``, ``reward.score_group`` sent
  BY NAME on the shared Celery fabric and awaited;
- ``HTTPServices``: ``POST /v1/rewards/match``, ``POST /v1/rollouts``, ``POST /v1/rewards`` with the
  typed clients of ``loom.clients``.
Both label chunks with the reflection model over its OpenAI-compatible HTTP API, send the chunks to
the verifier in batches the reward service accepts (``match_batches``), and report a failed call as a
``ServiceError`` (never a bare exception: anything else is a bug of this service).
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from loom.clients.base import LoomHTTPError
from loom.clients.reward import RewardClient
from loom.clients.rollout import RolloutClient
from loom.contracts.settings import Settings, get_settings
from loom.contracts.tasks import GENERATE_GROUP, MATCH_TEXTS, SCORE_GROUP
from loom.contracts.wire import Group, RewardResult, RewardSpec, RolloutRequest
from loom.queue import send
from reflect_svc.config import ReflectSettings
from reflect_svc.reflection_model import ModelError, ModelOutput, ReflectionModel
from reflect_svc.revise import ServiceError

_MATCH_META = ("numbers", "target")
# what an HTTP call can raise that is the other service's failure: transport, an error status, a
# body that is not the schema (JSON and pydantic errors are ValueErrors)
_HTTP_ERRORS = (httpx.HTTPError, LoomHTTPError, ValueError, KeyError, TypeError)


def match_request(group: Group, texts: list[str], timeout_s: int = 5) -> dict[str, Any]:
    return {
        "label": group.label,
        "task": group.task,
        "meta": {k: group.meta[k] for k in _MATCH_META if k in group.meta},
        "texts": texts,
        "timeout_s": timeout_s,
    }


def match_batches(texts: list[str], max_texts: int, max_chars: int) -> list[list[str]]:
    """Consecutive batches of at most ``max_texts`` texts and ``max_chars`` characters (a longer
    text goes alone): one match request each."""
    out: list[list[str]] = []
    chars = 0
    for text in texts:
        if not out or len(out[-1]) >= max_texts or (out[-1] and chars + len(text) > max_chars):
            out.append([])
            chars = 0
        out[-1].append(text)
        chars += len(text)
    return out


def matches_of(body: Any, n: int) -> list[bool]:
    try:
        verdicts = body["verdicts"]
        if len(verdicts) != n:
            raise ServiceError("verifier_error", f"{len(verdicts)} verdicts for {n} texts")
        return [bool(v["status"] == "ok" and v["correct"]) for v in verdicts]
    except (KeyError, TypeError) as exc:
        raise ServiceError("verifier_error", f"malformed match response: {type(exc).__name__}") from None


class ModelLabeler:
    def __init__(self, model: ReflectionModel | None) -> None:
        self.model = model

    def label(self, prompt: str, n_chunks: int) -> ModelOutput:
        if self.model is None:
            raise ServiceError("model_error", "no reflection model configured (LOOM_REFLECT_MODEL_URL)")
        try:
            return self.model.label(prompt, n_chunks)
        except ModelError as exc:
            raise ServiceError("model_error", str(exc)) from None


class HTTPServices(ModelLabeler):
    def __init__(
        self,
        rollout_url: str,
        reward_url: str,
        model: ReflectionModel | None = None,
        parallel: int = 4,
        match_batch: tuple[int, int] = (4096, 1_000_000),
    ) -> None:
        super().__init__(model)
        self.rollout = RolloutClient(rollout_url, timeout=600.0)
        self.reward = RewardClient(reward_url)
        self.parallel = parallel
        self.match_batch = match_batch  # (texts, characters) per match request

    def _match_one(self, group: Group, texts: list[str]) -> list[bool]:
        try:
            body = self.reward.post("/v1/rewards/match", json=match_request(group, texts))
        except _HTTP_ERRORS as exc:
            raise ServiceError("verifier_error", f"{type(exc).__name__}: {exc}") from None
        return matches_of(body, len(texts))

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        batches = match_batches(texts, *self.match_batch)
        with ThreadPoolExecutor(self.parallel) as ex:
            return [v for vs in ex.map(lambda b: self._match_one(group, b), batches) for v in vs]

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        try:
            with ThreadPoolExecutor(self.parallel) as ex:
                return list(ex.map(self.rollout.generate, requests))
        except _HTTP_ERRORS as exc:
            raise ServiceError("rollout_error", f"{type(exc).__name__}: {exc}") from None

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        try:
            return self.reward.score([group], spec)[0]
        except (*_HTTP_ERRORS, IndexError) as exc:
            raise ServiceError("reward_error", f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self.rollout.close()
        self.reward.close()


class QueueServices(ModelLabeler):
    def __init__(
        self,
        app: Any,
        model: ReflectionModel | None = None,
        timeout_s: float = 600.0,
        match_batch: tuple[int, int] = (4096, 1_000_000),
    ) -> None:
        super().__init__(model)
        self.app = app
        self.timeout_s = timeout_s
        self.match_batch = match_batch  # (texts, characters) per match task

    def _get(self, result: Any) -> Any:
        # Waiting inside a task is safe here: the subtasks run on other services' queues.
        return result.get(timeout=self.timeout_s, interval=0.05, disable_sync_subtasks=False)

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        batches = match_batches(texts, *self.match_batch)
        verdicts: list[bool] = []
        try:  # everything in here is the broker or the reward task: its failure, whatever its type
            pending = [send(self.app, MATCH_TEXTS, match_request(group, b)) for b in batches]
            bodies = [self._get(p) for p in pending]
        except Exception as exc:
            raise ServiceError("verifier_error", f"{type(exc).__name__}: {exc}") from None
        for b, body in zip(batches, bodies, strict=True):
            verdicts.extend(matches_of(body, len(b)))
        return verdicts

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        pending = []
        try:  # the broker, the rollout task, or an answer that is not a Group
            for r in requests:
                body = r.model_dump(mode="json")
                digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
                # keyed by the request: a redelivered reflect task reuses its rollouts, a new cut does not
                pending.append(send(self.app, GENERATE_GROUP, body, key=f"{r.group_id}:{digest}"))
            return [Group.model_validate(self._get(p)) for p in pending]
        except Exception as exc:
            raise ServiceError("rollout_error", f"{type(exc).__name__}: {exc}") from None

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        try:  # the broker, the reward task, or an answer that is not a RewardResult
            res = send(self.app, SCORE_GROUP, group, spec)
            return RewardResult.model_validate(self._get(res))
        except Exception as exc:
            raise ServiceError("reward_error", f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        return None


def reflection_model(cfg: ReflectSettings) -> ReflectionModel | None:
    if not cfg.model_url:
        return None
    return ReflectionModel(
        cfg.model_url,
        model=cfg.model_name,
        endpoint=cfg.model_endpoint,
        top_logprobs=cfg.model_top_logprobs,
        tokens_per_chunk=cfg.model_tokens_per_chunk,
        timeout_s=cfg.model_timeout_s,
    )


def make_services(
    cfg: ReflectSettings, app: Any, settings: Settings | None = None
) -> HTTPServices | QueueServices:
    settings = settings or get_settings()
    model = reflection_model(cfg)
    match_batch = (cfg.match_batch_texts, cfg.match_batch_chars)
    if cfg.transport == "http":
        return HTTPServices(
            cfg.rollout_url or settings.service_url("rollout"),
            cfg.reward_url or settings.service_url("reward"),
            model,
            cfg.parallel,
            match_batch,
        )
    return QueueServices(app, model, cfg.subtask_timeout_s, match_batch)


_tokenizers: dict[str, Any] = {}
_tok_lock = threading.Lock()


def policy_tokenizer(cfg: ReflectSettings, settings: Settings | None = None) -> Any:
    """The policy's tokenizer (cut offsets are the policy's tokens): the built-in tiny one or a path."""
    name = cfg.tokenizer or (settings or get_settings()).model
    with _tok_lock:
        if name not in _tokenizers:
            if name == "tiny":
                from zoo.tiny import load_tokenizer

                _tokenizers[name] = load_tokenizer()
            else:
                from transformers import AutoTokenizer

                _tokenizers[name] = AutoTokenizer.from_pretrained(name)
        return _tokenizers[name]
