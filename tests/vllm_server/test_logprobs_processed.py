"""vLLM with ``--logprobs-mode processed_logprobs``: its log-probs equal the learner's recomputation at
the sampling temperature, trajectories record the processing, and the learner uses them exactly when
its own processing is the same (temperature, and no top-p/top-k, which it does not apply).

The server runs without dev mode (vLLM's default; one server start for both): the dev routes do not
exist (404, as ``loom engine`` answers: tests/rollout/test_control.py), LoRA policies still load (no
dev route needed), and a full-checkpoint update is a clear error naming ``VLLM_SERVER_DEV_MODE``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.contracts.settings import Settings
from loom.contracts.wire import LogprobsProcessing, SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines import make_engine
from rollout_svc.engines.base import EngineRequestError
from rollout_svc.engines.vllm import VLLMEngine
from tests.rollout.control_cases import DEV_ROUTES
from tests.vllm_server.conftest import TINY, max_diff, reference_logprobs
from tests.vllm_server.test_logprobs import ATOL, _group, _train_metrics


@pytest.fixture
def engine(vllm: Any, arun: Any, tmp_path: Path) -> Any:
    settings = Settings(
        engine="vllm",
        engine_url=vllm.ensure("processed", dev=False),
        engine_logprobs_mode="processed",
        policy_store=tmp_path / "store",
    )
    engine = make_engine(settings)  # LOOM_ENGINE_LOGPROBS_MODE reaches the vLLM client
    assert engine.logprobs_kind == "processed"
    yield engine
    arun(engine.close())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.3, 2.0])
def test_processed_logprobs_match_the_learner_at_the_sampling_temperature(
    engine: Any, arun: Any, tokenizer: Any, prompt_ids: list[int], temperature: float
) -> None:
    group = _group(arun, engine, tokenizer, prompt_ids, temperature=temperature)
    for t in group.trajectories:
        assert t.logprobs_kind == "processed"
        assert t.logprobs_processing == LogprobsProcessing(temperature=temperature)
        ref = reference_logprobs(TINY, t.prompt_ids, t.completion_ids, temperature=temperature)
        assert max_diff(t.logprobs, ref) < ATOL


def test_the_learner_uses_processed_logprobs_of_its_own_temperature(
    engine: Any, arun: Any, tokenizer: Any, prompt_ids: list[int], tmp_path: Path
) -> None:
    group = _group(arun, engine, tokenizer, prompt_ids, temperature=1.3)
    same = _train_metrics(group, 1.3, tmp_path / "a")
    assert same["behaviour_logprobs_used"] == 1.0 and same["logprob_mismatch_max"] < ATOL
    other = _train_metrics(group, 1.0, tmp_path / "b")
    assert other["behaviour_logprobs_used"] == 0.0 and other["behaviour_logprobs_unmatched"] == 1.0


@pytest.mark.parametrize(("top_p", "top_k"), [(0.8, -1), (1.0, 5)])
def test_top_p_or_top_k_logprobs_are_not_the_learners_and_are_not_used(
    engine: Any, arun: Any, tokenizer: Any, prompt_ids: list[int], tmp_path: Path, top_p: float, top_k: int
) -> None:
    group = _group(arun, engine, tokenizer, prompt_ids, temperature=1.3, top_p=top_p, top_k=top_k)
    diffs = []
    for t in group.trajectories:
        assert t.logprobs_processing == LogprobsProcessing(temperature=1.3, top_p=top_p, top_k=top_k)
        ref = reference_logprobs(TINY, t.prompt_ids, t.completion_ids, temperature=1.3)
        diffs.append(max_diff(t.logprobs, ref))
    assert max(diffs) > 1e-2  # truncation renormalises: temperature alone does not reproduce them
    metrics = _train_metrics(group, 1.3, tmp_path)
    assert metrics["behaviour_logprobs_used"] == 0.0 and metrics["behaviour_logprobs_unmatched"] == 1.0


def test_without_dev_mode_loras_load_and_full_updates_say_what_is_missing(
    vllm: Any, arun: Any, full_and_lora: PolicyStore, prompt_ids: list[int]
) -> None:
    url = vllm.ensure("processed", dev=False)
    for method, path in DEV_ROUTES:
        r = httpx.request(method, f"{url}{path}", timeout=10)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), path
    engine = VLLMEngine(url, policy_store=full_and_lora.root, logprobs_mode="processed")
    try:  # temperature 1, no top-p / top-k: processed log-probs are the plain ones
        outs = arun(engine.generate(prompt_ids, SamplingParams(max_tokens=8, seed=1, temperature=1.0)))
        assert engine.policy_version == 0  # the served model
        assert max_diff(outs[0].logprobs, reference_logprobs(TINY, prompt_ids, outs[0].token_ids)) < ATOL
        lora = full_and_lora.get(2)
        assert lora is not None
        arun(engine.load_policy(lora))
        assert engine.policy_version == 2 and arun(engine.generate(prompt_ids, SamplingParams(max_tokens=4)))
        full = full_and_lora.get(1)
        assert full is not None
        with pytest.raises(EngineRequestError, match="VLLM_SERVER_DEV_MODE"):
            arun(engine.load_policy(full))
    finally:
        arun(engine.close())
