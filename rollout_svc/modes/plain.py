"""plain (docs/algorithms.md §2.1): n samples of one prompt, every completion token trained."""

from __future__ import annotations

import time

from loom.contracts.wire import Group, RolloutRequest
from rollout_svc.engines.base import Engine
from rollout_svc.modes import group_of, sampled, trajectory_id


async def plain(request: RolloutRequest, prompt_ids: list[int], group_id: str, engine: Engine) -> Group:
    t0 = time.perf_counter()
    outs = await engine.generate(prompt_ids, request.sampling)
    elapsed = time.perf_counter() - t0
    trajectories = [
        sampled(
            engine,
            trajectory_id(group_id, i),
            group_id,
            prompt_ids,
            completion_ids=c.token_ids,
            logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            timing={"generate_s": elapsed},
            meta={"top_logprobs": [{str(k): v for k, v in d.items()} for d in c.top_logprobs]}
            if c.top_logprobs is not None
            else {},
        )
        for i, c in enumerate(outs)
    ]
    return group_of(request, group_id, "plain", trajectories)
