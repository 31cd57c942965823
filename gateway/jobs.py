"""Jobs for external trainers: prompts in, scored groups out (stored one by one as they finish)."""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gateway.models import JobRequest
from gateway.pipeline import Cancelled, Stages, collect
from gateway.runs import adaptive_config, to_request
from gateway.state import GatewayState

log = logging.getLogger("loom.gateway.jobs")


def run_job(
    job_id: str, state: GatewayState, stages: Stages, stop: threading.Event, parallel: int = 8
) -> str:
    """Run (or resume) a job: every prompt not yet stored goes through the pipeline; returns the status."""
    row = state.job(job_id)
    if row is None:
        raise KeyError(job_id)
    req = JobRequest.model_validate(json.loads(row["request"]))
    items = req.items()
    adaptive = adaptive_config(req)
    done = state.job_done_indices(job_id)
    state.set_job(job_id, status="running")
    counters: dict[str, float] = json.loads(row["counters"] or "{}")
    lock = threading.Lock()

    def one(i: int) -> None:
        if stop.is_set():
            raise Cancelled("gateway stopping")
        got = collect(
            stages,
            f"{job_id}.p{i}",
            [to_request(items[i], req)],
            req.reward,
            adaptive=adaptive,
            policy_version=req.policy_version,
            reflect=req.reflect,
        )
        scored = got.groups[0]
        payload: dict[str, Any] = {"index": i, "group": None, "rewards": None}
        if scored is not None:
            payload["group"] = scored[0].model_dump(mode="json")
            payload["rewards"] = scored[1].model_dump(mode="json")
        with lock:
            for k, v in got.counters.items():
                if k == "adaptive_rounds_used":
                    counters[k] = max(counters.get(k, 0.0), v)
                elif k != "adaptive_samples_per_prompt":
                    counters[k] = counters.get(k, 0.0) + v
            if counters.get("adaptive_prompts"):
                counters["adaptive_samples_per_prompt"] = (
                    counters["adaptive_samples"] / counters["adaptive_prompts"]
                )
        state.add_job_group(job_id, i, payload)

    todo = [i for i in range(len(items)) if i not in done]
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(todo) or 1))) as pool:
            for f in [pool.submit(one, i) for i in todo]:
                f.result()
    except Cancelled:
        return "interrupted"
    except Exception as exc:
        log.exception("job %s failed", job_id)
        state.set_job(job_id, status="failed", error=f"{type(exc).__name__}: {exc}", counters=counters)
        return "failed"
    state.set_job(job_id, status="succeeded", counters=counters)
    return "succeeded"
