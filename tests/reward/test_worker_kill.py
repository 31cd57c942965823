"""Killing a reward worker mid-batch loses no group: the broker redelivers (late ack), and the
result is keyed by group id (idempotent)."""

import time

import pytest

from loom.contracts.wire import Group, RewardComponent, RewardResult, RewardSpec, Trajectory
from reward_svc.tasks import submit_group, task_key

pytestmark = pytest.mark.broker


def _group(i: int) -> Group:
    gid = f"kill-{i}"
    texts = ["\\boxed{(10^9)!}", f"\\boxed{{{i}}}", "\\boxed{-1}"]  # the first one costs its deadline
    return Group(
        id=gid,
        label=str(i),
        trajectories=[Trajectory(id=f"t{k}", group_id=gid, text=t) for k, t in enumerate(texts)],
    )


def test_killing_a_reward_worker_mid_batch_loses_no_group(broker_env, loom_worker):
    broker_env.extra_env["LOOM_REWARD_WORKERS"] = "1"
    first = loom_worker("reward", broker_env)
    app = broker_env.app("reward")
    spec = RewardSpec(components=[RewardComponent(name="accuracy")], timeout_s=2)
    groups = [_group(i) for i in range(3)]
    pending = [submit_group(g, spec, app=app) for g in groups]
    assert pending[0].id == task_key(groups[0], spec)
    deadline = time.monotonic() + 60
    while "reward.score_group" not in first.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # inside the first group's hostile item
    first.kill_group()
    loom_worker("reward", broker_env)
    for g, res in zip(groups, pending, strict=True):
        out = RewardResult.model_validate(res.get(timeout=120))
        assert out.group_id == g.id
        statuses = [r.status for r in out.rewards]
        assert statuses[0] in ("timeout", "parse_error") and statuses[1:] == ["ok", "ok"]
        assert [r.total for r in out.rewards] == [0.0, 1.0, 0.0]
    # re-sending a scored group returns the stored result instead of scoring it again
    again = submit_group(groups[0], spec, app=app).get(timeout=30)
    assert RewardResult.model_validate(again).group_id == groups[0].id
