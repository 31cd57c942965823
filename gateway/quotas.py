"""Per-key quotas (docs/security.md "Quotas"): what a job or run costs, and whether it fits.

A key's queued and running work holds at most ``jobs`` jobs and ``runs`` runs, and together at most
``samples`` completions and ``tokens`` generated completion tokens in flight. A job is charged by
its mode's worst case (gateway/cost.py: tree's every path, spawn's children, streaming's rounds,
adaptive sampling's every round) and settled to what it produced when it ends; a run costs the
samples of the steps it may generate at once ((staleness + 1) x its largest batch x samples per
prompt), and its whole length (x ``filter_max_batches``, the batches a filtered step may
draw) is bounded on its own by ``run_samples``.

A submission that could never fit (over a limit on its own) is a 422 naming the limit; one that fits
alone but not beside the key's other work is a 429 with Retry-After: it can be sent again once some of
that work has ended.

A key's stored datasets (its uploads and its runs' inline JSONL) hold at most ``dataset_bytes`` bytes
and ``datasets`` datasets: a dataset past them is a 413 (an upload stops as soon as its bytes pass
the limit). Stored ones are freed only by deleting them, so waiting would not help: no Retry-After.

Pure: no HTTP, no database (gateway/state.py checks in its insert transaction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.config import GatewaySettings

RETRY_AFTER_S = 30  # a quota frees when work ends: minutes, not the token bucket's seconds


@dataclass(frozen=True)
class Cost:
    samples: int
    tokens: int


@dataclass(frozen=True)
class Quotas:
    jobs: int
    runs: int
    samples: int
    tokens: int
    run_samples: int
    streams: int
    dataset_bytes: int = 4 * 1024**3
    datasets: int = 256

    @classmethod
    def from_settings(cls, config: GatewaySettings) -> Quotas:
        return cls(**{quota: getattr(config, name) for quota, name in _FIELD.items()})


# each quota's GatewaySettings field: the one table behind ``from_settings`` and ``SETTING``, the
# environment variable a refusal names
_FIELD = {
    "jobs": "quota_jobs",
    "runs": "quota_runs",
    "samples": "quota_samples",
    "tokens": "quota_tokens",
    "run_samples": "max_run_samples",
    "streams": "quota_streams",
    "dataset_bytes": "quota_dataset_bytes",
    "datasets": "quota_datasets",
}
_PREFIX = GatewaySettings.model_config["env_prefix"]
SETTING = {quota: f"{_PREFIX}{name}".upper() for quota, name in _FIELD.items()}


_RUN_WHAT = {"samples": "samples (batch x samples per prompt)", "tokens": "tokens (x max_tokens)"}


class QuotaExceeded(Exception):
    """422 (never fits) or 429 (not beside the key's other work); ``body()`` is the answer."""

    def __init__(self, status: int, quota: str, limit: int, requested: int, in_use: int, msg: str) -> None:
        self.status, self.quota, self.limit = status, quota, limit
        self.requested, self.in_use = requested, in_use
        super().__init__(msg)

    def body(self) -> dict[str, Any]:
        return {
            "error": "quota_exceeded",
            "detail": str(self),
            "quota": self.quota,
            "limit": self.limit,
            "requested": self.requested,
            "in_use": self.in_use,
        }

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None


def samples_per_prompt(req: Any) -> int:
    """Completions one prompt may cost: n, or M x R rounds with adaptive sampling."""
    a = getattr(req, "adaptive", None)
    if a is not None:
        return int(a.samples_per_round * a.max_rounds)
    return int(req.sampling.n)


def run_cost(req: Any) -> tuple[Cost, int]:
    """(the run's cost in flight, its samples over all its steps)."""
    sched = req.schedule
    largest = max(sched.batch_size, sched.max_batch) if sched.adaptive_batch else sched.batch_size
    per_step = largest * samples_per_prompt(req)
    samples = (sched.staleness + 1) * per_step
    # a filtered step may draw up to filter_max_batches batches, one after another: its whole length
    # counts them all, what it generates at once one
    return Cost(
        samples, samples * int(req.sampling.max_tokens)
    ), sched.steps * per_step * req.filter_max_batches


def too_long(total_samples: int, quotas: Quotas) -> QuotaExceeded | None:
    """A run longer than ``run_samples`` over all its steps: never accepted."""
    if total_samples <= quotas.run_samples:
        return None
    return QuotaExceeded(
        422,
        "run_samples",
        quotas.run_samples,
        total_samples,
        0,
        f"the run asks for {total_samples} samples over its steps (steps x batch x samples per prompt "
        "x filter_max_batches); "
        f"the limit is {quotas.run_samples} ({SETTING['run_samples']})",
    )


def over_quota(
    kind: str, cost: Cost, quotas: Quotas, *, jobs: int, runs: int, samples: int, tokens: int
) -> QuotaExceeded | None:
    """The first quota ``cost`` breaks beside a key's ``jobs``/``runs`` and the ``samples``/``tokens``
    they hold, or None."""
    for quota, need, held in (("samples", cost.samples, samples), ("tokens", cost.tokens, tokens)):
        limit = getattr(quotas, quota)
        if need > limit:
            if kind == "job":
                what = f"{quota} (its mode's worst case, docs/security.md 'Quotas')"
            else:
                what = (
                    "samples (batch x samples per prompt)" if quota == "samples" else "tokens (x max_tokens)"
                )
            return QuotaExceeded(
                422,
                quota,
                limit,
                need,
                held,
                f"the {kind} asks for {need} {what} in flight; a key may hold at most {limit} "
                f"({SETTING[quota]})",
            )
        if need + held > limit:
            return QuotaExceeded(
                429,
                quota,
                limit,
                need,
                held,
                f"the {kind} asks for {need} {quota} while this key's queued and running work holds {held} "
                f"of {limit} ({SETTING[quota]}); retry when some of it has ended",
            )
    count, limit, name = (jobs, quotas.jobs, "jobs") if kind == "job" else (runs, quotas.runs, "runs")
    if count + 1 > limit:
        return QuotaExceeded(
            429,
            name,
            limit,
            1,
            count,
            f"this key has {count} {name} queued or running, the most it may ({SETTING[name]}); "
            f"retry when one has ended (or cancel one)",
        )
    return None


def dataset_too_large(n_bytes: int, quotas: Quotas, bytes_held: int) -> QuotaExceeded:
    """413: a dataset of ``n_bytes`` (or an upload that has reached that many) does not fit beside the
    ``bytes_held`` bytes its key stores."""
    return QuotaExceeded(
        413,
        "dataset_bytes",
        quotas.dataset_bytes,
        n_bytes,
        bytes_held,
        f"the dataset reaches {n_bytes} bytes while this key stores {bytes_held} of "
        f"{quotas.dataset_bytes} ({SETTING['dataset_bytes']}); DELETE /v1/datasets/{{id}} frees some",
    )


def dataset_over_quota(
    n_bytes: int, quotas: Quotas, *, bytes_held: int, datasets_held: int
) -> QuotaExceeded | None:
    """The 413 when a new dataset of ``n_bytes`` does not fit beside the ``bytes_held`` bytes and
    ``datasets_held`` datasets its key stores; else None."""
    if n_bytes + bytes_held > quotas.dataset_bytes:
        return dataset_too_large(n_bytes, quotas, bytes_held)
    if datasets_held + 1 > quotas.datasets:
        return QuotaExceeded(
            413,
            "datasets",
            quotas.datasets,
            1,
            datasets_held,
            f"this key stores {datasets_held} datasets, the most it may ({SETTING['datasets']}); "
            "DELETE /v1/datasets/{id} frees one",
        )
    return None
