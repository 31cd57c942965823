"""One full cycle through real workers on the tiny model (issue 8 "Must show"):
rollout -> reward -> train step -> new version loaded by the engine -> next rollout carries it."""

from __future__ import annotations

import pytest

from loom.contracts.wire import Group, RewardResult, StepResult, TrainBatch
from zoo.tiny import plain_prompt, tiny_problems

pytestmark = pytest.mark.slow

SPEC = {"components": [{"name": "accuracy", "weight": 1.0}, {"name": "length_kimi", "weight": 0.5}]}


def test_train_step_publishes_a_version_that_the_next_rollout_carries(broker_env, loom_worker):
    for service in ("rollout", "reward", "learner"):
        loom_worker(service, broker_env, wait=False)
    app = broker_env.app("gateway")
    problem = tiny_problems("arith", 1, seed=7, split="train")[0]
    request = {
        "group_id": "cycle-0",
        "prompt": plain_prompt(problem),
        "label": problem.gold,
        "task": "arithmetic",
        "sampling": {"n": 6, "max_tokens": 64, "temperature": 1.0, "seed": 1},
    }
    group = Group.model_validate(
        app.send_task("rollout.generate_group", args=[request], task_id="cycle-0").get(timeout=180)
    )
    assert len(group.trajectories) == 6
    assert all(t.policy_version == 0 and t.text is not None for t in group.trajectories)

    rewards = RewardResult.model_validate(
        app.send_task("reward.score_group", args=[group.model_dump(mode="json"), SPEC]).get(timeout=120)
    )
    assert {r.trajectory_id for r in rewards.rewards} == {t.id for t in group.trajectories}
    totals = [r.total for r in rewards.rewards]
    assert max(totals) > min(totals), "the length component must give this group a non-zero advantage"

    batch = TrainBatch(step=0, groups=[group], rewards=[rewards], estimator="grpo")
    step = StepResult.model_validate(
        app.send_task("learner.train_step", args=[batch.model_dump(mode="json")]).get(timeout=180)
    )
    assert step.policy_version == 1
    assert step.policy is not None and step.policy.version == 1

    # The next rollout asks for version 1: the rollout worker loads it from the policy store.
    nxt = dict(request, group_id="cycle-1", policy_version=1)
    group2 = Group.model_validate(
        app.send_task("rollout.generate_group", args=[nxt], task_id="cycle-1").get(timeout=180)
    )
    assert all(t.policy_version == 1 for t in group2.trajectories)
    # Same seed and prompt, new weights: the behaviour log-probs of the first sampled token differ.
    assert group2.trajectories[0].logprobs != group.trajectories[0].logprobs
