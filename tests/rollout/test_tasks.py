"""rollout.generate_group through the real queue fabric (embedded broker and RabbitMQ).

The kill test drives a worker whose engine is `loom engine --simulate-ms-per-token` (the labelled
SIMULATION mode: a fixed, known generation time, so the kill reliably lands mid-group); what it
tests is the queue and the task, not the model. The exactness test runs the real torch engine in
the worker's engine process (the default), and so does the killed-engine-process test.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from loom.contracts.tasks import GENERATE_GROUP
from loom.contracts.wire import Group, RolloutRequest, SamplingParams
from loom.queue import send
from rollout_svc.engines.torch import teacher_forced_logprobs
from tests.rollout.conftest import start_engine_server, stop_process


@pytest.fixture(scope="module")
def sim_server() -> Iterator[str]:
    proc, url = start_engine_server(["--simulate-ms-per-token", "20"])
    try:
        yield url
    finally:
        stop_process(proc)


def wait_state(result: Any, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result.state == state:
            return
        time.sleep(0.05)
    raise AssertionError(f"task never reached {state} (last {result.state})")


@pytest.mark.broker
@pytest.mark.slow
def test_killed_worker_mid_group_is_regenerated_and_recorded_once(
    broker_env: Any, loom_worker: Any, sim_server: str
) -> None:
    broker_env.extra_env.update(LOOM_ENGINE="vllm", LOOM_ENGINE_URL=sim_server)
    app = broker_env.app("rollout")
    first = loom_worker("rollout", broker_env)
    gid = f"g-kill-{uuid.uuid4().hex[:8]}"  # results outlive the test in a shared Redis: unique ids
    req = RolloutRequest(group_id=gid, prompt_ids=[1, 2, 3], sampling=SamplingParams(n=2, max_tokens=150))
    result = send(app, GENERATE_GROUP, req, key=req.group_id)
    wait_state(result, "STARTED")
    killed = {first.pid, *first.children()}
    first.kill_group()
    loom_worker("rollout", broker_env)
    group = Group.model_validate(result.get(timeout=60))
    assert group.id == gid and [t.id for t in group.trajectories] == [f"{gid}/0", f"{gid}/1"]
    assert group.meta["worker_pid"] not in killed
    assert all(len(t.completion_ids) == 150 for t in group.trajectories)
    # a second publication of the same group returns the recorded result instead of generating again
    again = send(app, GENERATE_GROUP, req, key=req.group_id)
    assert Group.model_validate(again.get(timeout=30)).meta["generated_at"] == group.meta["generated_at"]


@pytest.mark.broker
@pytest.mark.slow
def test_a_ready_group_waits_at_the_engine_and_a_kill_loses_no_group(
    broker_env: Any, loom_worker: Any, sim_server: str
) -> None:
    """With an engine server, a worker run with -c 1 holds one more group ready (LOOM_ROLLOUT_READY's
    default): two groups are started at once, one of them waiting at the engine's door, a third stays
    in the broker; killed, the worker loses none of them, and groups never share the engine's slot."""
    broker_env.extra_env.update(LOOM_ENGINE="vllm", LOOM_ENGINE_URL=sim_server)
    app = broker_env.app("rollout")
    first = loom_worker("rollout", broker_env)
    tag = uuid.uuid4().hex[:8]
    reqs = [
        RolloutRequest(
            group_id=f"g-ready-{tag}-{i}", prompt_ids=[1, 2, i], sampling=SamplingParams(n=1, max_tokens=40)
        )
        for i in range(3)
    ]
    results = [send(app, GENERATE_GROUP, r, key=r.group_id) for r in reqs]
    wait_state(results[0], "STARTED")
    wait_state(results[1], "STARTED")  # received and marked started while group 0 holds the engine
    time.sleep(0.2)
    assert [r.state for r in results] == ["STARTED", "STARTED", "PENDING"]
    killed = {first.pid, *first.children()}
    first.kill_group()
    loom_worker("rollout", broker_env)
    groups = [Group.model_validate(r.get(timeout=60)) for r in results]
    assert [g.id for g in groups] == [r.group_id for r in reqs]
    assert all(g.meta["worker_pid"] not in killed for g in groups)
    spans = sorted(
        (g.meta["generated_at"] - g.trajectories[0].timing["generate_s"], g.meta["generated_at"])
        for g in groups
    )
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end - 0.05  # one group on the engine at a time (-c 1): no overlap


@pytest.mark.broker
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_worker_streaming_group_is_token_exact(
    broker_env: Any, loom_worker: Any, model_dir: Path, reference_model: Any
) -> None:
    broker_env.extra_env.update(LOOM_ENGINE="torch", LOOM_MODEL=str(model_dir))
    app = broker_env.app("rollout")
    loom_worker("rollout", broker_env)
    req = RolloutRequest(
        group_id=f"g-stream-{uuid.uuid4().hex[:8]}",
        mode="streaming",
        prompt="[stream]",
        sampling=SamplingParams(n=2, max_tokens=8, seed=3),
        mode_params={"sentences": ["one two.", "three four."], "segment_cap": 5, "answer_max_tokens": 4},
    )
    group = Group.model_validate(send(app, GENERATE_GROUP, req).get(timeout=90))
    assert group.mode == "streaming" and len(group.trajectories) == 2
    for t in group.trajectories:
        assert t.engine == "torch" and t.loss_mask is not None
        ref = teacher_forced_logprobs(reference_model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
        trained = [i for i, m in enumerate(t.loss_mask) if m]
        assert [t.logprobs[i] for i in trained] == pytest.approx([ref[i] for i in trained], abs=1e-4)


def engine_process(worker: Any, timeout: float = 60.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(worker.pid).children(recursive=True):
            try:
                if "rollout_svc.engines.process" in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.1)
    raise AssertionError("the worker started no engine process")


@pytest.mark.broker
@pytest.mark.slow
@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_a_killed_engine_process_fails_the_group_typed_and_its_retry_regenerates_it(
    broker_env: Any, loom_worker: Any, model_dir: Path
) -> None:
    """The engine process (LOOM_ENGINE_PROCESS's default) dies with a group on it: the call fails with
    EngineUnavailable, the task retries, the next call starts a new engine process, the same worker
    records the group once."""
    broker_env.extra_env.update(LOOM_ENGINE="torch", LOOM_MODEL=str(model_dir))
    app = broker_env.app("rollout")
    worker = loom_worker("rollout", broker_env)
    tag = uuid.uuid4().hex[:8]

    def request(i: int) -> RolloutRequest:
        return RolloutRequest(
            group_id=f"g-engine-{tag}-{i}", prompt_ids=[5, 6, 7], sampling=SamplingParams(n=2, max_tokens=6)
        )

    first = request(0)
    send(app, GENERATE_GROUP, first, key=first.group_id).get(timeout=90)
    engine = engine_process(worker)
    engine.suspend()  # SIGSTOP: the next group's call is surely in flight when the process dies
    second = request(1)
    result = send(app, GENERATE_GROUP, second, key=second.group_id)
    wait_state(result, "STARTED")
    time.sleep(0.3)
    os.kill(engine.pid, signal.SIGKILL)
    group = Group.model_validate(result.get(timeout=90))
    assert group.id == second.group_id and len(group.trajectories) == 2
    assert group.meta["worker_pid"] == worker.pid and group.meta["retries"] >= 1
    assert "exited with code -9" in worker.log()
    assert engine_process(worker).pid != engine.pid
