"""Client of the learner service, and the learner-side helpers the gateway needs.

``adaptive_batch_size`` lives here (not in ``learner/``) because the gateway, which samples the next
batch, must not import another service package.
"""

from __future__ import annotations

from typing import Any

from loom.clients.base import ServiceClient
from loom.schemas import StepResult, TrainBatch


def adaptive_batch_size(
    batch_size: int,
    n_valid: int,
    target: int,
    *,
    lam: float = 0.9,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """AttnRL eq. 10: B_{m+1} = Round(lambda B_m + (1 - lambda) B' / B''_m * B_m).

    ``batch_size`` = B_m (prompts sampled at step m), ``n_valid`` = B''_m (groups with a non-zero
    advantage at step m), ``target`` = B' (the wanted number of valid groups). With B''_m = 0 the
    ratio is taken with B''_m = 1 (the largest step the formula allows for one valid group).
    The result is clamped to [minimum, maximum].
    """
    if batch_size < 1 or target < 1:
        raise ValueError("batch_size and target must be >= 1")
    ratio = target / max(n_valid, 1)
    nxt = round(lam * batch_size + (1.0 - lam) * ratio * batch_size)
    nxt = max(minimum, nxt)
    if maximum is not None:
        nxt = min(maximum, nxt)
    return int(nxt)


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
