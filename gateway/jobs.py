"""Jobs for external trainers: prompts in, scored groups out (stored one by one as they finish).

A job is a coroutine (gateway/manager.py runs it): up to ``parallel`` of its prompts are in the
pipeline at once, and while it waits on its tasks it holds futures, not threads.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

from gateway.cost import produced
from gateway.models import JobRequest
from gateway.pipeline import Cancelled, Coalescer
from gateway.quotas import Cost
from gateway.runs import to_request
from gateway.state import GatewayState
from gateway.step import Stages, StepConfig, collect, gather_all
from loom.contracts.policies import is_run_namespace
from loom.contracts.wire import RolloutRequest
from loom.timeline import mark

log = logging.getLogger("loom.gateway.jobs")


# the workers' typed failures that are the request's own doing (docs/security.md, "Error answers")
INVALID_PARAMS = frozenset({"ModeError", "InvalidPrompt", "UnsupportedCapability", "ValidationError"})
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])/[^\s'\"(),;]+")


def job_error(exc: BaseException, req: JobRequest, job_id: str) -> str:
    """What a failed job's ``error`` says: a typed kind and a sentence, never a server path or an
    exception's text from a worker (which may name the store's folders); the log keeps both.
    ``policy_load_error``: the version named could not be loaded; ``invalid_params``: the request's
    own parameters, with the worker's sentence (its paths masked); else ``internal_error``."""
    kind = type(exc).__name__
    if kind == "PolicyLoadError":
        which = "the served policy" if req.policy_version is None else f"policy version {req.policy_version}"
        return f"policy_load_error: {which} could not be loaded (the operator's log has the reason)"
    if kind in INVALID_PARAMS:
        return f"invalid_params: {ABSOLUTE_PATH.sub('<path>', str(exc))}"
    return f"internal_error: the job failed; the gateway's log has the reason (job {job_id})"


def at_policy(request: RolloutRequest, req: JobRequest) -> RolloutRequest:
    """``request`` at the job's policy namespace and match (the version is ``collect``'s), its mode
    parameters the resolved form the submission stored (gateway/validate.py)."""
    at = {"policy_namespace": req.policy_namespace, "policy_match": req.policy_match}
    return request.model_copy(update={**at, "mode_params_resolved": True})


def _owner_of(state: GatewayState, run_id: str) -> str | None:
    run = state.runs.get(run_id)
    return None if run is None else run.owner


async def run_job(job_id: str, state: GatewayState, stages: Stages, parallel: int = 8) -> str:
    """Run (or resume) a job: every prompt not yet stored goes through the pipeline; returns the status
    (``interrupted`` when the gateway stops: the job stays ``running`` and is resumed at the next start).
    A cancel (``POST /v1/jobs/{id}/cancel``) cancels this coroutine (gateway/manager.py)."""
    row = state.jobs.get(job_id)
    if row is None:
        raise KeyError(job_id)
    req = JobRequest.model_validate(row.request)
    ns = req.policy_namespace
    if ns not in (None, row.owner) and not (is_run_namespace(ns) and _owner_of(state, ns) == row.owner):
        # the submission refuses it (gateway/validate.py ``visible``); a stored row too
        error = f"policy version {req.policy_version} is not in the policy store"
        await asyncio.to_thread(state.jobs.finish, job_id, "failed", error=error)
        return "failed"
    items = req.items()
    cfg = StepConfig.of(req)
    done = state.jobs.done_indices(job_id)
    if not await asyncio.to_thread(state.jobs.start, job_id):  # cancelled before it started
        return state.jobs.status(job_id) or "cancelled"
    counters: dict[str, float] = dict(row.counters)
    slots = asyncio.Semaphore(parallel)

    async def write(groups: list[tuple[int, dict[str, Any], Cost]]) -> list[BaseException | None]:
        stored = [(i, payload) for i, payload, _ in groups]
        await asyncio.to_thread(state.jobs.add_groups, job_id, stored, [c for _, _, c in groups])
        return [None] * len(groups)

    # the groups scored in one turn of the loop (one reward task's, read together) in one commit
    store: Coalescer[tuple[int, dict[str, Any], Cost]] = Coalescer(write)

    async def one(i: int) -> None:
        async with slots:
            got = await collect(
                stages,
                f"{job_id}.p{i}",
                [at_policy(to_request(items[i], req), req)],
                cfg,
                req.policy_version,
            )
        scored = got.groups[0]
        payload: dict[str, Any] = {"index": i, "group": None, "rewards": None}
        if scored is not None:
            payload["group"] = scored[0].model_dump(mode="json")
            payload["rewards"] = scored[1].model_dump(mode="json")
        for k, v in got.counters.items():  # one event loop: no lock needed
            if k == "adaptive_rounds_used":
                counters[k] = max(counters.get(k, 0.0), v)
            elif k != "adaptive_samples_per_prompt":
                counters[k] = counters.get(k, 0.0) + v
        if counters.get("adaptive_prompts"):
            per_prompt = counters["adaptive_samples"] / counters["adaptive_prompts"]
            counters["adaptive_samples_per_prompt"] = per_prompt
        await store.add((i, payload, produced(g for g, _ in got.sampled)))
        mark("stored", f"{job_id}.p{i}")

    try:
        await gather_all(one(i) for i in range(len(items)) if i not in done)
    except Cancelled:
        return "interrupted"
    except Exception as exc:
        log.exception("job %s failed", job_id)
        error = job_error(exc, req, job_id)
        await asyncio.to_thread(state.jobs.finish, job_id, "failed", error=error, counters=counters)
        return "failed"
    if await asyncio.to_thread(state.jobs.finish, job_id, "succeeded", counters=counters):
        return "succeeded"
    return state.jobs.status(job_id) or "cancelled"
