"""Client of the learner service."""

from __future__ import annotations

from typing import Any

from loom.clients.base import ServiceClient
from loom.contracts.wire import StepResult, TrainBatch


class LearnerClient(ServiceClient):
    """``POST /v1/train_step`` (one optimizer step, returns the new policy version)."""

    def train_step(self, batch: TrainBatch, *, timeout: float | None = None) -> StepResult:
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        body = self.post("/v1/train_step", json=batch.model_dump(mode="json"), **kwargs)
        return StepResult.model_validate(body)

    def score_attention(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/score/attention``: FCI scores of a response's steps (AttnRL eq. 6-7)."""
        return dict(self.post("/v1/score/attention", json=body))
