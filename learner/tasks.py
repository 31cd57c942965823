"""Celery tasks of the learner service (queue ``learner``): thin shells over the core modules.

Run ONE learner worker with concurrency 1: it owns the policy (``loom worker learner -c 1``).
"""

from __future__ import annotations

import threading
from typing import Any

from learner.train import Learner, LearnerConfig
from loom.contracts.settings import Settings, get_settings
from loom.contracts.wire import TrainBatch
from loom.queue import make_celery
from loom.runtime import configure_process

celery_app = make_celery("learner")

_learner: Learner | None = None
_lock = threading.Lock()


def learner_config(settings: Settings) -> LearnerConfig:
    return LearnerConfig(model=settings.model, store=settings.policy_store_path, device=settings.device)


def get_learner() -> Learner:
    """The process's Learner, created on first use (resumes from the newest stored version)."""
    global _learner
    with _lock:
        if _learner is None:
            configure_process()
            _learner = Learner(learner_config(get_settings()))
        return _learner


@celery_app.task(name="learner.train_step")
def train_step(batch: dict[str, Any]) -> dict[str, Any]:
    """One optimizer step on ``batch`` (a TrainBatch); returns the StepResult with the new
    PolicyVersion, which the caller broadcasts to the engines."""
    parsed = TrainBatch.model_validate(batch)
    learner = get_learner()
    with _lock:
        result = learner.train_step(parsed)
    return result.model_dump(mode="json")


@celery_app.task(name="learner.score_attention")
def score_attention(
    token_ids: list[int], steps: list[list[int]], delta: int = 4, zero_from: int | None = None
) -> dict[str, Any]:
    """FCI scores of the steps of ``token_ids`` under the current policy (AttnRL eq. 6-7)."""
    from learner.attention import fci_scores
    from learner.train import check_vocabulary

    learner = get_learner()
    check_vocabulary(learner.model, [token_ids])
    with _lock:
        scores = fci_scores(
            learner.model, token_ids, [(int(a), int(b)) for a, b in steps], delta=delta, zero_from=zero_from
        )
    return {"scores": scores, "policy_version": learner.version}
