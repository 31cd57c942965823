"""Multi-LoRA on the real vLLM (``--enable-lora --max-loras 2``, docs/vllm.md): requests naming two
adapters and the base, sent at once, each answered with its own adapter's log-probs (against the
merged weights' recomputation, and against the torch engine's batched LoRA path on the same tokens)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from tests.vllm_server.conftest import SERVED, TINY, max_diff, reference_logprobs, write_lora

ATOL = 1e-4


def test_requests_naming_two_adapters_and_the_base_at_once_get_their_own_logprobs(
    vllm: Any, prompt_ids: list[int], tmp_path: Path
) -> None:
    from rollout_svc.engines.torch import TorchEngine

    url = vllm.ensure("raw")
    parts = {
        name: write_lora(tmp_path / name, seed=seed) for name, seed in (("mlora-a", 31), ("mlora-b", 32))
    }
    for name in parts:
        r = httpx.post(
            f"{url}/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(tmp_path / name)},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    models = [*parts, SERVED] * 2  # 6 requests in flight together: 2 per adapter, 2 of the base

    async def ask(client: httpx.AsyncClient, model: str, seed: int) -> tuple[str, list[int], list[float]]:
        body = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
        }
        r = await client.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return model, choice["token_ids"], choice["logprobs"]["token_logprobs"]

    async def flow() -> list[tuple[str, list[int], list[float]]]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(ask(client, m, i) for i, m in enumerate(models)))

    engine = TorchEngine(TINY, cache_entries=0)
    try:
        got = asyncio.run(flow())
        views = {name: engine.adapted_sync(str(tmp_path / name)) for name in parts}
        for model, tokens, logprobs in got:
            ref = reference_logprobs(TINY, prompt_ids, tokens, lora=parts.get(model))
            assert max_diff(logprobs, ref) < ATOL, model
            if model in parts:  # the adapter mattered, and the torch engine's LoRA rows agree
                assert max_diff(logprobs, reference_logprobs(TINY, prompt_ids, tokens)) > 0.05
                scored = views[model].prompt_logprobs_sync(prompt_ids + tokens, 0)[len(prompt_ids) :]
                torch_lp = [d[t][0] for d, t in zip(scored, tokens, strict=True) if d is not None]
                assert max_diff(logprobs, torch_lp) < ATOL, model
    finally:
        engine.stop_scheduler()
        for name in parts:
            httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)
