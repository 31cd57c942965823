"""A scratch rollout mode, the whole of it (tests/features/test_one_registration.py registers it):
``rounds`` plain generations of the prompt, one group; it needs its params and no text."""

from __future__ import annotations

from loom.contracts.wire import Group, RolloutRequest, Trajectory
from rollout_svc.engines.base import Engine
from rollout_svc.modes import group_of, trajectory_id
from tests.features.scratch.contracts import ScratchModeParams

NEEDS = ("params",)


async def scratch(
    request: RolloutRequest, prompt_ids: list[int], group_id: str, engine: Engine, cfg: ScratchModeParams
) -> Group:
    trajectories: list[Trajectory] = []
    for _ in range(cfg.rounds):
        for c in await engine.generate(prompt_ids, request.sampling):
            trajectories.append(
                Trajectory(
                    id=trajectory_id(group_id, len(trajectories)),
                    group_id=group_id,
                    prompt_ids=prompt_ids,
                    completion_ids=c.token_ids,
                    logprobs=c.logprobs,
                    logprobs_kind=engine.logprobs_kind,
                    finish_reason=c.finish_reason,
                )
            )
    return group_of(request, group_id, "scratch", trajectories)
