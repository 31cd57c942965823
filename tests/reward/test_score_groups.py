"""``reward.score_groups``, the gateway's batched reward task (issue 34): each member's result under its
own key, a member with a result skipped, a failing member failed alone, a hostile answer costing only
its own group its deadline, and a worker killed mid-batch losing nothing (late ack: redelivered, the
members without a result scored by the next worker)."""

import json
import time
import uuid

import pytest
from celery import states

from loom.contracts.wire import Group, RewardComponent, RewardResult, RewardSpec, Trajectory

pytestmark = pytest.mark.broker


def _group(gid: str, gold: int, hostile: bool = False) -> Group:
    texts = [f"\\boxed{{{gold}}}", "\\boxed{-1}"]
    if hostile:
        texts.insert(0, "\\boxed{(10^9)!}")  # costs its per-item deadline
    return Group(
        id=gid,
        label=str(gold),
        trajectories=[Trajectory(id=f"t{k}", group_id=gid, text=t) for k, t in enumerate(texts)],
    )


def _wait(app, key: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        meta = app.backend.get_task_meta(key)
        if meta["status"] in states.READY_STATES:
            return meta
        time.sleep(0.05)
    raise AssertionError(f"no result under {key} in {timeout} s")


def test_a_batch_stores_each_member_under_its_key_and_survives_a_killed_worker(
    broker_env, loom_worker, tmp_path
):
    timeline = tmp_path / "timeline.jsonl"
    broker_env.extra_env.update(LOOM_REWARD_WORKERS="1", LOOM_TIMELINE=str(timeline))
    first = loom_worker("reward", broker_env)
    app = broker_env.app("gateway")
    spec = RewardSpec(components=[RewardComponent(name="accuracy")], timeout_s=5).model_dump(mode="json")
    job = f"b{uuid.uuid4().hex[:8]}"
    keys = [f"{job}.p{i}.score" for i in range(5)]
    groups = [_group(f"{job}.p0", 7, hostile=True), _group(f"{job}.p1", 8), _group(f"{job}.p2", 9)]
    sentinel = {"group_id": "kept", "rewards": []}
    app.backend.store_result(keys[3], sentinel, states.SUCCESS)  # scored before: skipped
    bad_spec = {**spec, "components": [{"name": "no-such-component"}]}
    members = [[keys[i], g.model_dump(mode="json"), spec] for i, g in enumerate(groups)]
    members += [[keys[3], _group(f"{job}.p3", 1).model_dump(mode="json"), spec]]
    members += [[keys[4], _group(f"{job}.p4", 2).model_dump(mode="json"), bad_spec]]
    app.send_task("reward.score_groups", args=[members], task_id=f"scores-{uuid.uuid4().hex}")

    # the groups without a hostile answer are stored while the hostile one still runs to its deadline
    for key in keys[1:3]:
        meta = _wait(app, key, 120)
        assert meta["status"] == states.SUCCESS
    assert app.backend.get_task_meta(keys[0])["status"] not in states.READY_STATES
    first.kill_group()  # inside the hostile item: the batch's message is not acknowledged
    loom_worker("reward", broker_env)

    for key, g, gold_total in zip(keys, groups, ([0.0, 1.0, 0.0], [1.0, 0.0], [1.0, 0.0]), strict=False):
        out = RewardResult.model_validate(_wait(app, key, 120)["result"])
        assert out.group_id == g.id
        assert [r.total for r in out.rewards] == gold_total
    hostile = RewardResult.model_validate(app.backend.get_task_meta(keys[0])["result"])
    assert hostile.rewards[0].status in ("timeout", "parse_error")
    assert app.backend.get_task_meta(keys[3])["result"] == sentinel
    failed = _wait(app, keys[4], 30)
    assert failed["status"] == states.FAILURE and "no-such-component" in str(failed["result"])

    starts = [json.loads(line) for line in timeline.read_text().splitlines()]
    started = [m["key"] for m in starts if m["event"] == "score_start"]
    assert keys[3] not in started  # a member with a result is never scored
    # the first worker scored p1 and p2; after the kill the second scored only what had no result
    assert started.count(keys[1]) == 1 and started.count(keys[2]) == 1
    assert started.count(keys[0]) == 2


def test_no_reward_component_reads_log_probs():
    """The gateway leaves a group's log-probs out of its reward task (gateway/pipeline.py
    ``REWARD_DROPS``): every registered component must score a group the same without them."""
    from gateway.pipeline import for_reward
    from reward_svc.core import score_group
    from reward_svc.mathverify import Verdict
    from reward_svc.registry import REGISTRY

    texts = [
        "<think>so 12</think> \\boxed{12}",
        "\\boxed{11}",
        "<think>hmm</think>",
        "the answer is 12 " * 20,
    ]
    trajs = [
        Trajectory(
            id=f"t{k}",
            group_id="g",
            completion_ids=list(range(5 + 7 * k)),
            logprobs=[-0.5 - 0.1 * i for i in range(5 + 7 * k)],
            text=t,
        )
        for k, t in enumerate(texts)
    ]
    group = Group(id="g", label="12", trajectories=trajs)
    light = Group.model_validate(for_reward(group))
    assert all(t.logprobs is None for t in light.trajectories)

    def verify(items, timeout_s):  # the same verdicts either way: the answer's region read as is
        return [Verdict(status="ok", correct=item.region.strip() == item.gold) for item in items]

    for name in REGISTRY:
        spec = RewardSpec(components=[RewardComponent(name=name)])
        a, b = score_group(group, spec, verify), score_group(light, spec, verify)
        assert a.model_dump(exclude={"score_s"}) == b.model_dump(exclude={"score_s"}), name
    totals = score_group(group, RewardSpec(components=[RewardComponent(name="accuracy")]), verify)
    assert [r.total for r in totals.rewards] == [1.0, 0.0, 0.0, 0.0]  # the check is not vacuous
