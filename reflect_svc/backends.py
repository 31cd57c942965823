"""The ``Services`` the core needs, over the queues or over HTTP (no service package is imported).

- ``QueueServices``: ``reward.match_texts``, ``rollout.generate_group``, ``reward.score_group`` sent
  BY NAME on the shared Celery fabric and awaited;
- ``HTTPServices``: ``POST /v1/rewards/match``, ``POST /v1/rollouts``, ``POST /v1/rewards`` with the
  typed clients of ``loom.clients``.
Both label chunks with the reflection model over its OpenAI-compatible HTTP API.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from loom.clients.reward import RewardClient
from loom.clients.rollout import RolloutClient
from loom.schemas import Group, RewardResult, RewardSpec, RolloutRequest
from loom.settings import Settings, get_settings
from reflect_svc.config import ReflectSettings
from reflect_svc.reflection_model import ModelError, ModelOutput, ReflectionModel
from reflect_svc.revise import ServiceError

_MATCH_META = ("numbers", "target")


def match_request(group: Group, texts: list[str], timeout_s: int = 5) -> dict[str, Any]:
    return {
        "label": group.label,
        "task": group.task,
        "meta": {k: group.meta[k] for k in _MATCH_META if k in group.meta},
        "texts": texts,
        "timeout_s": timeout_s,
    }


def matches_of(body: Any, n: int) -> list[bool]:
    verdicts = body["verdicts"]
    if len(verdicts) != n:
        raise ServiceError("verifier_error", f"{len(verdicts)} verdicts for {n} texts")
    return [bool(v["status"] == "ok" and v["correct"]) for v in verdicts]


class _ModelLabeler:
    def __init__(self, model: ReflectionModel | None) -> None:
        self.model = model

    def label(self, prompt: str, n_chunks: int) -> ModelOutput:
        if self.model is None:
            raise ServiceError("model_error", "no reflection model configured (LOOM_REFLECT_MODEL_URL)")
        try:
            return self.model.label(prompt, n_chunks)
        except ModelError as exc:
            raise ServiceError("model_error", str(exc)) from None


class HTTPServices(_ModelLabeler):
    def __init__(
        self, rollout_url: str, reward_url: str, model: ReflectionModel | None = None, parallel: int = 4
    ) -> None:
        super().__init__(model)
        self.rollout = RolloutClient(rollout_url, timeout=600.0)
        self.reward = RewardClient(reward_url)
        self.parallel = parallel

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        try:
            body = self.reward.post("/v1/rewards/match", json=match_request(group, texts))
        except Exception as exc:
            raise ServiceError("verifier_error", f"{type(exc).__name__}: {exc}") from None
        return matches_of(body, len(texts))

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        with ThreadPoolExecutor(self.parallel) as ex:
            return list(ex.map(self.rollout.generate, requests))

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        return self.reward.score([group], spec)[0]

    def close(self) -> None:
        self.rollout.close()
        self.reward.close()


class QueueServices(_ModelLabeler):
    def __init__(self, app: Any, model: ReflectionModel | None = None, timeout_s: float = 600.0) -> None:
        super().__init__(model)
        self.app = app
        self.timeout_s = timeout_s

    def _get(self, result: Any) -> Any:
        # Waiting inside a task is safe here: the subtasks run on other services' queues.
        return result.get(timeout=self.timeout_s, interval=0.05, disable_sync_subtasks=False)

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        try:
            body = self._get(self.app.send_task("reward.match_texts", args=[match_request(group, texts)]))
        except Exception as exc:
            raise ServiceError("verifier_error", f"{type(exc).__name__}: {exc}") from None
        return matches_of(body, len(texts))

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        pending = []
        for r in requests:
            body = r.model_dump(mode="json")
            digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
            # keyed by the request: a redelivered reflect task reuses its rollouts, a new cut does not
            pending.append(
                self.app.send_task("rollout.generate_group", args=[body], task_id=f"{r.group_id}:{digest}")
            )
        return [Group.model_validate(self._get(p)) for p in pending]

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        res = self.app.send_task(
            "reward.score_group", args=[group.model_dump(mode="json"), spec.model_dump(mode="json")]
        )
        return RewardResult.model_validate(self._get(res))

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
    if cfg.transport == "http":
        return HTTPServices(
            cfg.rollout_url or settings.service_url("rollout"),
            cfg.reward_url or settings.service_url("reward"),
            model,
            cfg.parallel,
        )
    return QueueServices(app, model, cfg.subtask_timeout_s)


_tokenizers: dict[str, Any] = {}
_tok_lock = threading.Lock()


def policy_tokenizer(cfg: ReflectSettings, settings: Settings | None = None) -> Any:
    """The policy's tokenizer (cut offsets are the policy's tokens): the built-in tiny one or a path."""
    name = cfg.tokenizer or (settings or get_settings()).model
    with _tok_lock:
        if name not in _tokenizers:
            if name == "tiny":
                from loom.tiny import load_tokenizer

                _tokenizers[name] = load_tokenizer()
            else:
                from transformers import AutoTokenizer

                _tokenizers[name] = AutoTokenizer.from_pretrained(name)
        return _tokenizers[name]
