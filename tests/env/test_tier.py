"""The env tier end to end: real ``loom worker env`` processes on RabbitMQ (and the embedded broker,
``loom up``'s default), agent episodes on Loom's tiny model in the real torch engine. Token exactness
through the tier, per-turn rewards, and every fault a typed end: an environment that raises, hangs or
never says done, a worker SIGKILLed mid-episode (env_lost, the group returned), one killed mid-open
(the open redelivered to another worker), no worker at all (env_lost, nothing hangs)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from loom.clients.env import EnvSession, close_env_client, get_env_client
from loom.clients.rollouts import env_mask
from loom.contracts.envs import EnvTask
from loom.contracts.modes import parse_mode_params
from loom.contracts.wire import Group, RolloutRequest, SamplingParams
from loom.formats import ends_with
from rollout_svc.engines.base import Completion
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.modes.agent import Agent, agent, trajectory
from tests.conftest import (
    RABBITMQ_URL,
    REDIS_RESULTS_URL,
    SESSION_ID,
    BrokerEnv,
    Worker,
    _reachable,
    start_worker,
)

PROMPT = "Q: reach 6 with 1, 2 and 3.\n"
TIMEOUT = "timeout"
COUNTDOWN = {"numbers": [1, 2, 3], "target": 6}


@contextmanager
def tier(tmp: Path, workers: int = 1, **env: str) -> Iterator[tuple[BrokerEnv, list[Worker]]]:
    """Env workers in a RabbitMQ namespace of their own, this process's settings pointed at it."""
    if not _reachable("127.0.0.1", 5672):
        pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672")
    benv = BrokerEnv(
        kind="rabbitmq",
        tmp=tmp,
        env={
            "LOOM_DATA_DIR": str(tmp / "loom-data"),
            "LOOM_BROKER_URL": RABBITMQ_URL,
            "LOOM_RESULT_BACKEND": REDIS_RESULTS_URL,
            "LOOM_QUEUE_NAMESPACE": f"loomtest-{SESSION_ID}-env-{uuid.uuid4().hex[:6]}-",
            "LOOM_ENV_MODULES": '["tests.env.faulty"]',
            "LOOM_ENV_GRACE_S": "1",
            **env,
        },
    )
    mp = pytest.MonkeyPatch()
    started = [start_worker(benv, "env", concurrency=8, wait=False) for _ in range(workers)]
    try:
        for w in started:
            w.wait_ready()
        benv.apply(mp)
        close_env_client()
        yield benv, started
    finally:
        close_env_client()
        for w in started:
            w.kill_group()
        mp.undo()
        benv.close()


@pytest.fixture(scope="module")
def env_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerEnv, list[Worker]]]:
    with tier(tmp_path_factory.mktemp("env-tier")) as t:
        yield t


def _request(n: int = 1, max_tokens: int = 48, **mode_params: Any) -> RolloutRequest:
    return RolloutRequest(
        mode="agent",
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n, seed=1),
        mode_params=mode_params,
    )


def _group(engine: Any, n: int = 2, **mode_params: Any) -> Group:
    """The real agent mode's group: the engine's turns, the environment on the tier."""
    request = _request(n=n, max_tokens=4, **mode_params)
    prompt_ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = parse_mode_params(request)
    return asyncio.run(agent(request, prompt_ids, "g", engine, engine.tokenizer, params))  # type: ignore[arg-type]


def _forced(runner: Agent, engine: Any, script: list[str]) -> Any:
    """The policy's turns written by the test, scored by the model's own teacher-forced pass."""

    async def turn(ids: list[int], max_tokens: int, k: int) -> Completion:
        toks = runner.encode(script[k])[:max_tokens]
        lp = teacher_forced_logprobs(engine.model, ids + toks, len(ids))
        called = ends_with(toks, runner.close_ids)
        return Completion(toks, lp, "stop", runner.syntax.call_close if called else None)

    return turn


def test_countdown_through_the_env_worker_is_token_exact_with_per_turn_rewards(env_tier, tiny_engine) -> None:
    request = _request(max_turns=4, environment="countdown", env_options=COUNTDOWN)
    runner = Agent(request, tiny_engine, tiny_engine.tokenizer, parse_mode_params(request))  # type: ignore[arg-type]
    prompt_ids = tiny_engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    script = ["so \\boxed{1+2}", "no: \\boxed{1+2+3}"]
    ep = asyncio.run(runner.env_episode(prompt_ids, _forced(runner, tiny_engine, script), 0))
    t = trajectory("g", 0, prompt_ids, ep, tiny_engine, 0.0)
    turns = [s for s in t.segments if s.kind == "turn"]
    (obs,) = [s for s in t.segments if s.kind == "observation"]
    want_obs = runner.encode("\n<tool_response>\nincorrect (try 1 of 3)\n</tool_response>\n")
    # completion = policy turn 0 + the environment's observation + policy turn 1, exactly
    assert t.completion_ids == runner.encode(script[0]) + want_obs + runner.encode(script[1])
    assert t.completion_ids[obs.start : obs.end] == want_obs
    assert env_mask(t) == [0 if obs.start <= i < obs.end else 1 for i in range(len(t.completion_ids))]
    assert t.loss_mask == env_mask(t) and t.logprobs[obs.start : obs.end] == [0.0] * len(want_obs)
    assert [s.meta["reward"] for s in turns] == [0.0, 1.0] == t.meta["turn_rewards"]
    assert [s.meta["env_status"] for s in turns] == ["ok", "ok"] and obs.meta["status"] == "ok"
    assert (t.stop_reason, t.finish_reason) == ("env_done", "stop")


@pytest.mark.parametrize(
    ("environment", "options", "stop", "turns", "observed", "rewards"),
    [
        ("faulty:NeverDone", {"first": "hi"}, "max_turns", ["ok"] * 3, ["ok"] * 3, [0.5] * 3),
        ("faulty:Raises", {}, "max_turns", ["env_error"] * 3, ["env_error"] * 2, [None] * 3),
        ("faulty:Hangs", {"sleep_s": 3}, "max_turns", ["ok", TIMEOUT, TIMEOUT], ["ok", TIMEOUT], [None] * 3),
        ("faulty:RaisesOnReset", {}, "env_error", [], [], []),
        ("faulty:Missing", {}, "unknown_env", [], [], []),
    ],
)
def test_every_fault_is_a_typed_end_and_the_group_survives(
    env_tier, tiny_engine, environment, options, stop, turns, observed, rewards
) -> None:
    """``observed``: the observations' statuses (NeverDone's first: its reset's); the last turn has none."""
    params = {"environment": f"tests.env.{environment}", "env_options": options, "tool_timeout_s": 0.5}
    group = _group(tiny_engine, max_turns=3, **params)
    assert len(group.trajectories) == 2 and group.meta["stop"] == [stop, stop]
    for t in group.trajectories:
        assert [s.meta["env_status"] for s in t.segments if s.kind == "turn"] == turns
        assert [s.meta["status"] for s in t.segments if s.kind == "observation"] == observed
        assert t.meta["turn_rewards"] == rewards
        assert t.loss_mask == env_mask(t)  # observations 0, the policy's turns 1


def test_a_worker_killed_mid_episode_is_env_lost_and_nothing_hangs(tmp_path: Path, tiny_engine) -> None:
    marker = tmp_path / "step-started"
    with tier(tmp_path, LOOM_ENV_OPEN_TIMEOUT_S="2") as (_, (worker,)):
        options = {"marker": str(marker), "sleep_s": 60}
        out: list[Group] = []
        params = {"environment": "tests.env.faulty:Hangs", "env_options": options, "tool_timeout_s": 4}
        runner = threading.Thread(target=lambda: out.append(_group(tiny_engine, max_turns=3, **params)))
        runner.start()
        while not marker.exists() or marker.read_text() != "1":  # the second step runs in the worker
            assert runner.is_alive()
            time.sleep(0.02)
        worker.kill()  # SIGKILL: its episodes' state and its own queue go with it
        runner.join(timeout=60)
        assert not runner.is_alive(), "an episode hangs on a killed env worker"
        (group,) = out
        assert group.meta["stop"] == ["env_lost", "env_lost"]
        for t in group.trajectories:
            turns = [s for s in t.segments if s.kind == "turn"]
            assert [s.meta["env_status"] for s in turns] == ["ok", "env_lost"]
            assert t.finish_reason == "abort"
        # no env worker at all: the open's bounded wait ends the next episode, typed
        (t,) = _group(tiny_engine, n=1, max_turns=3, **params).trajectories
        assert t.stop_reason == "env_lost" and t.completion_ids == []


def test_an_open_whose_worker_is_killed_is_redelivered_to_another(tmp_path: Path) -> None:
    marker = tmp_path / "first-reset"
    with tier(tmp_path, workers=2, LOOM_ENV_OPEN_TIMEOUT_S="30") as (_, workers):

        async def episode() -> tuple[EnvSession, Any]:
            task = EnvTask(environment="tests.env.faulty:SlowFirstReset", options={"opener": str(marker)})
            session = await EnvSession.open(get_env_client(), task)
            return session, await session.step("a", None, 0, 5)

        async def kill_the_first_opener() -> tuple[EnvSession, Any]:
            job = asyncio.ensure_future(episode())
            while not marker.exists() or not marker.read_text():
                await asyncio.sleep(0.02)
            (victim,) = [w for w in workers if w.pid == int(marker.read_text())]
            victim.kill()
            return await job

        session, step = asyncio.run(kill_the_first_opener())
        (survivor,) = [w for w in workers if str(w.pid) != marker.read_text()]
        assert session.reset.status == "ok" and f".{survivor.pid}." in session.opened.queue
        assert step.status == "ok" and step.observation == "turn 0 seen"


@pytest.mark.parametrize("broker_env", ["embedded"], indirect=True)
def test_the_embedded_broker_serves_the_tier(broker_env, loom_worker, monkeypatch) -> None:
    """``loom up``'s default: the tier on the embedded broker and result store, sticky steps too."""
    loom_worker("env", broker_env, concurrency=2)
    broker_env.apply(monkeypatch)
    close_env_client()

    async def episode() -> list[Any]:
        task = EnvTask(environment="countdown", options={**COUNTDOWN, "max_tries": 2})
        session = await EnvSession.open(get_env_client(), task)
        answers = ["\\boxed{3+3}", "\\boxed{1+2+3}"]
        steps = [await session.step(text, None, k, 10) for k, text in enumerate(answers)]
        await session.close()
        return [session.reset.status, *[(s.reward, s.done) for s in steps]]

    try:
        assert asyncio.run(episode()) == ["ok", (0.0, False), (1.0, True)]
    finally:
        close_env_client()
