"""`loom worker learner --nproc 2` on RabbitMQ: a step trains on two ranks; after a rank is killed
the next batch's step fails on rank 0, which ends its worker process instead of acknowledging the
message, and the broker redelivers the batch to the restarted worker, which trains it on new ranks.
Without --nproc the worker takes its ranks and their layout from LOOM_LEARNER_NPROC and
LOOM_LEARNER_SHARDING (FSDP here)."""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from loom.contracts.wire import StepResult, TrainBatch
from loom.store import PolicyStore

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def _helpers(pid: int) -> list[psutil.Process]:
    return [
        p
        for p in psutil.Process(pid).children(recursive=True)
        if "learner.helper_rank" in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize("broker_env", ["rabbitmq"], indirect=True)
def test_a_killed_rank_makes_the_batch_redelivered_and_trained_once(
    broker_env, loom_worker, model_dir, batch_parts
):
    broker_env.extra_env["LOOM_MODEL"] = str(model_dir)
    worker = loom_worker("learner", broker_env, args=("--nproc", "2"))
    app = broker_env.app("learner")
    groups, rewards = batch_parts(n_groups=2, seed=5)

    def step(i: int) -> StepResult:
        batch = TrainBatch(step=i, groups=groups, rewards=rewards).model_dump(mode="json")
        return StepResult.model_validate(app.send_task("learner.train_step", args=[batch]).get(timeout=240))

    assert step(0).policy_version == 1
    (helper,) = _helpers(worker.pid)
    helper.send_signal(signal.SIGKILL)
    second = step(1)  # redelivered after rank 0 exits; trained by the restarted worker's new ranks
    assert second.policy_version == 2 and "replayed" not in second.metrics
    assert "a learner rank failed; exiting for redelivery" in worker.log()
    assert PolicyStore(broker_env.settings.policy_store_path).versions() == [1, 2]
    deadline = time.monotonic() + 30
    while [p.pid for p in _helpers(worker.pid)] in ([], [helper.pid]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p.pid for p in _helpers(worker.pid)] not in ([], [helper.pid])  # new ranks serve on


@pytest.mark.parametrize("broker_env", ["rabbitmq"], indirect=True)
def test_the_worker_takes_fsdp_ranks_from_its_settings(broker_env, loom_worker, model_dir, batch_parts):
    from safetensors.torch import load_file

    broker_env.extra_env.update(
        {"LOOM_MODEL": str(model_dir), "LOOM_LEARNER_NPROC": "2", "LOOM_LEARNER_SHARDING": "fsdp"}
    )
    worker = loom_worker("learner", broker_env)  # no --nproc
    app = broker_env.app("learner")
    groups, rewards = batch_parts(n_groups=2, seed=5)
    batch = TrainBatch(step=0, groups=groups, rewards=rewards).model_dump(mode="json")
    result = StepResult.model_validate(app.send_task("learner.train_step", args=[batch]).get(timeout=240))
    assert result.policy_version == 1 and result.policy is not None
    assert len(_helpers(worker.pid)) == 1  # rank 1
    config = json.loads(_helpers(worker.pid)[0].cmdline()[-1])
    assert config["sharding"] == "fsdp"
    weights = load_file(f"{result.policy.path}/model.safetensors")  # the plain checkpoint, gathered
    assert weights and all(v.dtype.is_floating_point for v in weights.values())
    assert (broker_env.settings.policy_store_path / "sharded" / "v1").is_dir()
    # the FCI scores need the whole model in one process: refused with its reason, the ranks serve on
    ids = groups[0].trajectories[0].prompt_ids + groups[0].trajectories[0].completion_ids
    with pytest.raises(ValueError, match="LOOM_LEARNER_SHARDING=fsdp"):
        app.send_task("learner.score_attention", args=[ids, [[1, 3]]]).get(timeout=60)
    batch = TrainBatch(step=1, groups=groups, rewards=rewards).model_dump(mode="json")
    again = StepResult.model_validate(app.send_task("learner.train_step", args=[batch]).get(timeout=240))
    assert again.policy_version == 2
