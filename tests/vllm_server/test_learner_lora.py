"""The learner's own LoRA adapter (peft, rank 8, published as ``kind=lora``) on the real vLLM: it loads
through runtime LoRA loading and vLLM samples with the log-probs of the learner's merged model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from learner import logprobs as lp
from learner.config import LearnerSettings
from learner.train import Learner
from loom.contracts.wire import LossSpec, SamplingParams, TrainBatch, Trajectory
from rollout_svc.engines.vllm import VLLMEngine, lora_name
from tests.learner.conftest import make_batch_parts
from tests.vllm_server.conftest import TINY, max_diff, reference_logprobs

pytest.importorskip("peft")

ATOL = 1e-4  # as tests/vllm_server/test_lora.py: vLLM's CPU kernels against the HF forward, float32


def _logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    t = Trajectory(
        id="t", group_id="g", prompt_ids=prompt, completion_ids=tokens, loss_mask=[1] * len(tokens)
    )
    with torch.no_grad():
        out, _, _ = lp.completion_logprobs(model, [lp.layout_of(t)])
    return [float(x) for x in out[0, : len(tokens)]]


@pytest.mark.slow
def test_the_learners_adapter_loads_in_vllm_and_serves_the_merged_policy(
    vllm: Any, arun: Any, prompt_ids: list[int], tmp_path: Path
) -> None:
    learner = Learner(LearnerSettings(model=TINY, store=tmp_path / "store", lora_rank=8, lora_alpha=16))
    groups, rewards = make_batch_parts(streaming=False, behaviour=None)
    for step in range(3):
        learner.train_step(TrainBatch(step=step, groups=groups, rewards=rewards, loss=LossSpec(lr=5e-3)))
    policy = learner.record
    assert policy is not None and policy.kind == "lora" and policy.version == 3
    merged = copy.deepcopy(learner.model).merge_and_unload().eval()

    url = vllm.ensure("raw")
    engine = VLLMEngine(url, policy_store=learner.store.root)
    try:
        arun(engine.load_policy(policy))
        assert engine.model == lora_name(policy)
        outs = arun(engine.generate(prompt_ids, SamplingParams(n=2, max_tokens=16, seed=4)))
        for c in outs:
            assert max_diff(c.logprobs, _logprobs(merged, prompt_ids, c.token_ids)) < ATOL
            assert max_diff(c.logprobs, reference_logprobs(TINY, prompt_ids, c.token_ids)) > 10 * ATOL
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": lora_name(policy)}, timeout=30)
        arun(engine.close())
