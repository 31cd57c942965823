"""Celery tasks of the learner service (queue ``learner``): thin shells over the core modules.

Run ONE learner worker with concurrency 1: it owns the policy (``loom worker learner -c 1``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from learner.config import LearnerSettings
from learner.distributed import RankFailure
from learner.helper_rank import start_ranks
from learner.train import Learner
from loom.contracts.tasks import SCORE_ATTENTION, TRAIN_STEP
from loom.contracts.wire import TrainBatch
from loom.queue import make_celery, task_of
from loom.runtime import configure_process

celery_app = make_celery("learner")

_learner: Learner | None = None
_lock = threading.Lock()
_nproc = 1
log = logging.getLogger("loom.learner")

RANK_FAILURE_EXIT = 70  # EX_SOFTWARE: the worker process ends so the broker redelivers the batch


def set_nproc(n: int) -> None:
    """Train as ``n`` ranks (``loom worker learner --nproc N``): this process is rank 0 and starts
    ranks 1..n-1 as its children when the learner is first used (learner/helper_rank.py)."""
    global _nproc
    _nproc = max(1, int(n))


def get_learner() -> Learner:
    """The process's Learner, created on first use (resumes from the newest stored version)."""
    global _learner
    with _lock:
        if _learner is None:
            configure_process()
            cfg = LearnerSettings()
            _learner = Learner(cfg, ranks=start_ranks(_nproc, cfg) if _nproc > 1 else None)
        return _learner


@task_of(celery_app, TRAIN_STEP)
def train_step(batch: dict[str, Any]) -> dict[str, Any]:
    """One optimizer step on ``batch`` (a TrainBatch); returns the StepResult with the new
    PolicyVersion, which the next step's requests name (each replica pulls it from the store)."""
    parsed = TrainBatch.model_validate(batch)
    learner = get_learner()
    with _lock:
        try:
            result = learner.train_step(parsed)
        except RankFailure:
            # acknowledging a failed task would drop the batch: end the process instead, so the late
            # ack never happens and the broker redelivers it to the restarted worker (new ranks)
            log.critical("step %d: a learner rank failed; exiting for redelivery", parsed.step, exc_info=True)
            logging.shutdown()
            os._exit(RANK_FAILURE_EXIT)
    return result.model_dump(mode="json")


@task_of(celery_app, SCORE_ATTENTION)
def score_attention(
    token_ids: list[int],
    steps: list[list[int]],
    delta: int = 4,
    zero_from: int | None = None,
    policy_version: int = 0,
    policy_namespace: str | None = None,
) -> dict[str, Any]:
    """FCI scores of the steps of ``token_ids`` (AttnRL eq. 6-7) under exactly ``policy_version`` of
    ``policy_namespace`` (0: the base model), the policy the rollout generates with, whichever lineage
    trained last (docs/security.md "Runs' lineages"); a version it cannot load is an
    ``attention_version_unavailable`` answer, never another version's scores."""
    from learner.attention import fci_scores
    from learner.train import AttentionVersionUnavailable, check_vocabulary

    learner = get_learner()
    if learner.ranks.sharded:
        # a forward on rank 0 alone would wait for the other ranks' all-gathers
        raise ValueError(
            "score_attention needs the whole model in one process: not with LOOM_LEARNER_SHARDING=fsdp "
            "(score with an engine, LOOM_ATTENTION_URL)"
        )
    check_vocabulary(learner.model, [token_ids])
    with _lock:
        try:
            model = learner.scoring_model(policy_namespace, policy_version)
        except AttentionVersionUnavailable as exc:
            return {"error": "attention_version_unavailable", "detail": str(exc)}
        spans = [(int(a), int(b)) for a, b in steps]
        scores = fci_scores(model, token_ids, spans, delta=delta, zero_from=zero_from)
    namespace = None if policy_version == 0 else policy_namespace
    return {"scores": scores, "policy_version": policy_version, "policy_namespace": namespace}
