"""What the environment-library episode tests share (tests/env/test_verifiers_adapter.py,
tests/env/test_skyrl_adapter.py): a real ``loom worker env`` on RabbitMQ in a namespace of its own,
started from a given interpreter (the side one for verifiers, docs/environments.md "Environment
libraries"), this process's settings pointed at it; and one agent episode of the real agent mode on
Loom's tiny model in the real torch engine (tests/env/conftest.py), its turns written by the test
and scored by the model's own teacher-forced pass, its environment on that worker."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from loom.clients.env import close_env_client
from loom.contracts.modes import parse_mode_params
from loom.contracts.wire import RolloutRequest, SamplingParams, Trajectory
from loom.formats import ends_with
from rollout_svc.engines.base import Completion
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.modes.agent import Agent, trajectory
from tests.conftest import RABBITMQ_URL, REDIS_RESULTS_URL, SESSION_ID, BrokerEnv, _reachable, start_worker


@contextmanager
def env_worker(tmp: Path, python: str | None = None, **env: str) -> Iterator[BrokerEnv]:
    if not _reachable("127.0.0.1", 5672):
        pytest.skip("RabbitMQ is not reachable at 127.0.0.1:5672")
    benv = BrokerEnv(
        kind="rabbitmq",
        tmp=tmp,
        env={
            "LOOM_DATA_DIR": str(tmp / "loom-data"),
            "LOOM_BROKER_URL": RABBITMQ_URL,
            "LOOM_RESULT_BACKEND": REDIS_RESULTS_URL,
            "LOOM_QUEUE_NAMESPACE": f"loomtest-{SESSION_ID}-envlib-{uuid.uuid4().hex[:6]}-",
            **env,
        },
    )
    mp = pytest.MonkeyPatch()
    worker = start_worker(benv, "env", concurrency=2, python=python)
    try:
        benv.apply(mp)
        close_env_client()
        yield benv
    finally:
        close_env_client()
        worker.kill_group()
        mp.undo()
        benv.close()


def episode(engine: Any, prompt: str, label: str, script: list[str], **mode_params: Any) -> Trajectory:
    """One agent episode in ``mode_params["environment"]``, the policy's turns ``script``."""
    request = RolloutRequest(
        mode="agent",
        prompt=prompt,
        label=label,
        sampling=SamplingParams(max_tokens=64, temperature=0.0, n=1, seed=1),
        mode_params={"tool_timeout_s": 30.0, **mode_params},
    )
    runner = Agent(request, engine, engine.tokenizer, parse_mode_params(request))  # type: ignore[arg-type]

    async def turn(ids: list[int], max_tokens: int, k: int) -> Completion:
        toks = runner.encode(script[k])[:max_tokens]
        lp = teacher_forced_logprobs(engine.model, ids + toks, len(ids))
        called = ends_with(toks, runner.close_ids)
        return Completion(toks, lp, "stop", runner.syntax.call_close if called else None)

    prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    ep = asyncio.run(runner.env_episode(prompt_ids, turn, 0))
    return trajectory("g", 0, prompt_ids, ep, engine, 0.0)
