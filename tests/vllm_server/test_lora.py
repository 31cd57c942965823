"""LoRA policies on the real vLLM: an adapter from the policy store loads under a name of its own
(vLLM answers the load in plain text), requests name it and get exactly the merged weights' log-probs,
only the newest ``lora_keep`` adapters stay loaded, and the base model keeps being served."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.contracts.wire import SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines.vllm import VLLMEngine, lora_name
from tests.vllm_server.conftest import SERVED, TINY, max_diff, reference_logprobs, write_lora

ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[PolicyStore, dict[int, dict[str, Any]]]:
    store = PolicyStore(tmp_path_factory.mktemp("lora-policy"))
    parts: dict[int, dict[str, Any]] = {}
    for v in (1, 2, 3):
        store.publish(v, lambda d, v=v: parts.__setitem__(v, write_lora(d, seed=v)), kind="lora")
    return store, parts


def _models(url: str) -> list[str]:
    return [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]


def test_lora_policies_load_serve_and_unload_keeping_the_newest(
    vllm: Any, arun: Any, adapters: Any, prompt_ids: list[int]
) -> None:
    store, parts = adapters
    url = vllm.ensure("raw")
    engine = VLLMEngine(url, policy_store=store.root, lora_keep=2)
    try:
        for v in (1, 2, 3):
            policy = store.get(v)
            assert policy is not None and policy.kind == "lora"
            arun(engine.load_policy(policy))
            assert engine.model == lora_name(policy) and engine.policy_version == v
            outs = arun(engine.generate(prompt_ids, SamplingParams(n=2, max_tokens=24, seed=v)))
            for c in outs:
                merged = reference_logprobs(TINY, prompt_ids, c.token_ids, lora=parts[v])
                assert max_diff(c.logprobs, merged) < ATOL
                assert max_diff(c.logprobs, reference_logprobs(TINY, prompt_ids, c.token_ids)) > 0.05
        served = _models(url)
        names = {v: lora_name(store.get(v)) for v in (1, 2, 3)}  # type: ignore[arg-type]
        assert names[1] not in served and {names[2], names[3]} <= set(served) and SERVED in served
        # the base model is still served to whoever names it
        r = httpx.post(
            f"{url}/v1/completions", json={"model": SERVED, "prompt": prompt_ids, "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200
    finally:
        for name in _models(url):
            if name != SERVED:
                httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
        arun(engine.close())


def test_the_load_and_unload_answers_are_plain_text(vllm: Any, adapters: Any, tmp_path: Path) -> None:
    url = vllm.ensure("raw")
    path = write_lora(tmp_path / "a", seed=5) and tmp_path / "a"
    r = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "text-check", "lora_path": str(path)}, timeout=60
    )
    assert (r.status_code, r.headers.get("content-type"), r.text) == (
        200,
        None,
        "Success: LoRA adapter 'text-check' added successfully.",
    )
    again = httpx.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": "text-check", "lora_path": str(path)}, timeout=60
    )
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "text-check"}, timeout=60)
    assert (r.status_code, r.headers.get("content-type"), r.text) == (
        200,
        None,
        "Success: LoRA adapter 'text-check' removed successfully.",
    )


def test_reloading_the_same_lora_policy_is_not_an_error(vllm: Any, arun: Any, adapters: Any) -> None:
    store, _ = adapters
    url = vllm.ensure("raw")
    policy = store.get(1)
    assert policy is not None
    clients = [VLLMEngine(url, policy_store=store.root) for _ in range(2)]
    try:
        for c in clients:  # two replicas load the same version: the second finds it loaded
            arun(c.load_policy(policy))
            assert c.model == lora_name(policy)
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": lora_name(policy)}, timeout=30)
        for c in clients:
            arun(c.close())
