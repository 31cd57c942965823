"""A vLLM server that goes away mid-run: the client's requests fail as ``EngineUnavailable`` while it
is down (a Celery task retries those); the restarted server holds its base weights under vLLM's
``default`` label, and the client, which had loaded version 1, notices and loads version 1 again
before generating. (A server without dev mode: tests/vllm_server/test_logprobs_processed.py.)"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from loom.contracts.wire import SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines.base import EngineUnavailable
from rollout_svc.engines.vllm import VLLMEngine
from tests.vllm_server.conftest import max_diff, reference_logprobs

ATOL = 1e-4


def test_a_restarted_server_is_brought_back_to_the_clients_version(
    vllm: Any, arun: Any, full_and_lora: PolicyStore, prompt_ids: list[int]
) -> None:
    engine = VLLMEngine(vllm.ensure("raw"), policy_store=full_and_lora.root, retries=1, backoff=0.05)
    v1 = full_and_lora.get(1)
    assert v1 is not None
    params = SamplingParams(n=2, max_tokens=16, seed=4)
    try:
        arun(engine.load_policy(v1))
        arun(engine.generate(prompt_ids, params))
        vllm.stop()
        with pytest.raises(EngineUnavailable):
            arun(engine.generate(prompt_ids, params))
        vllm.restart()
        assert httpx.get(f"{vllm.url}/weight_info", timeout=10).json() == {"weight_version": "default"}
        outs = arun(engine.generate(prompt_ids, params))
        assert engine.policy_version == 1
        for c in outs:
            assert max_diff(c.logprobs, reference_logprobs(v1.path, prompt_ids, c.token_ids)) < ATOL
    finally:
        arun(engine.close())
