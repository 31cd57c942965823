"""`loom worker learner --nproc 2` on RabbitMQ: a step trains on two ranks; after a rank is killed
the next batch's step fails on rank 0, which ends its worker process instead of acknowledging the
message, and the broker redelivers the batch to the restarted worker, which trains it on new ranks."""

from __future__ import annotations

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
        if "learner.distributed" in " ".join(p.cmdline())
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
