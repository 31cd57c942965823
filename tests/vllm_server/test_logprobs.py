"""Behaviour log-probs from the real vLLM agree with the learner's recomputation (learner.logprobs):
raw ones with the learner at temperature 1 whatever the sampling temperature, processed ones with the
learner at the sampling temperature; the engine reports which kind it returns (read from the server),
trajectories carry the processing, and the learner uses them only when they match its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from learner.config import LearnerSettings
from learner.train import Learner
from loom.contracts.settings import Settings
from loom.contracts.wire import (
    LossSpec,
    RewardResult,
    RolloutRequest,
    SamplingParams,
    TrainBatch,
    TrajectoryReward,
)
from rollout_svc.engines.vllm import VLLMEngine
from rollout_svc.rollout import generate_group
from tests.vllm_server.conftest import TINY, max_diff, reference_logprobs

ATOL = 1e-4


def _group(arun: Any, engine: VLLMEngine, tokenizer: Any, prompt_ids: list[int], **sampling: Any) -> Any:
    req = RolloutRequest(
        prompt_ids=prompt_ids, sampling=SamplingParams(n=3, max_tokens=32, seed=7, logprobs=0, **sampling)
    )
    return arun(generate_group(req, engine, lambda: tokenizer, Settings()))


@pytest.fixture
def raw_engine(vllm: Any, arun: Any) -> Any:
    # the client is told "processed" on purpose: the server's --logprobs-mode is what counts
    engine = VLLMEngine(vllm.ensure("raw"), logprobs_mode="processed", retries=1)
    yield engine
    arun(engine.close())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.4, 2.0])
def test_raw_logprobs_match_the_learner_at_temperature_one(
    raw_engine: VLLMEngine, arun: Any, tokenizer: Any, prompt_ids: list[int], temperature: float
) -> None:
    group = _group(arun, raw_engine, tokenizer, prompt_ids, temperature=temperature)
    assert raw_engine.logprobs_kind == "raw"  # read from the server, not taken from the client's setting
    for t in group.trajectories:
        assert t.logprobs_kind == "raw" and t.logprobs_processing is None
        ref = reference_logprobs(TINY, t.prompt_ids, t.completion_ids, temperature=1.0)
        assert max_diff(t.logprobs, ref) < ATOL


def test_vllm_refuses_a_temperature_above_two_and_loom_refuses_it_first(
    raw_engine: VLLMEngine, arun: Any
) -> None:
    import httpx
    from pydantic import ValidationError

    r = httpx.post(
        f"{raw_engine.base_url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "temperature": 2.01},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=2.01)


def _train_metrics(group: Any, temperature: float, tmp_path: Path) -> dict[str, float]:
    rewards = [
        TrajectoryReward(trajectory_id=t.id, total=float(i % 2)) for i, t in enumerate(group.trajectories)
    ]
    learner = Learner(LearnerSettings(model=TINY, store=tmp_path / "learner"))
    batch = TrainBatch(
        step=0,
        groups=[group],
        rewards=[RewardResult(group_id=group.id, rewards=rewards)],
        loss=LossSpec(temperature=temperature, lr=1e-6),
    )
    return learner.train_step(batch).metrics


def test_the_learner_uses_raw_logprobs_only_at_temperature_one(
    raw_engine: VLLMEngine, arun: Any, tokenizer: Any, prompt_ids: list[int], tmp_path: Path
) -> None:
    group = _group(arun, raw_engine, tokenizer, prompt_ids, temperature=1.3)
    at_one = _train_metrics(group, 1.0, tmp_path / "a")
    assert at_one["behaviour_logprobs_used"] == 1.0 and at_one["logprob_mismatch_max"] < ATOL
    tempered = _train_metrics(group, 1.3, tmp_path / "b")
    assert tempered["behaviour_logprobs_used"] == 0.0 and tempered["behaviour_logprobs_unmatched"] == 1.0
