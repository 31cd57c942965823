"""Prefix-KV reuse of the torch engine: streaming rounds and repeated prefixes cost only new tokens."""

from __future__ import annotations

from typing import Any

import httpx

from loom.contracts.settings import Settings
from loom.contracts.wire import RolloutRequest, SamplingParams
from rollout_svc.engines.torch import TorchEngine
from rollout_svc.rollout import generate_group

SENTENCES = ["we have 3, 5 and 7.", "make 15 from them.", "it is a sunny day.", "take your time."]


def fresh(torch_engine: Any, entries: int = 8) -> TorchEngine:
    return TorchEngine(
        torch_engine.model_path,
        model=torch_engine.model,
        tokenizer=torch_engine.tokenizer,
        cache_entries=entries,
    )


def stream(arun: Any, engine: Any, n: int = 1) -> Any:
    req = RolloutRequest(
        mode="streaming",
        prompt="[stream]",
        sampling=SamplingParams(n=n, max_tokens=10, seed=2),
        mode_params={"sentences": SENTENCES, "segment_cap": 8, "answer_max_tokens": 5},
    )
    return arun(generate_group(req, engine, lambda: engine.tokenizer, Settings()))


def test_streaming_rounds_compute_every_token_once(torch_engine: Any, arun: Any) -> None:
    cached, naive = fresh(torch_engine), fresh(torch_engine, entries=0)
    (t,) = stream(arun, cached).trajectories
    (u,) = stream(arun, naive).trajectories
    assert t.completion_ids == u.completion_ids  # the cache changes the cost, never the tokens
    assert (
        t.logprobs == u.logprobs
        or max(abs(a - b) for a, b in zip(t.logprobs, u.logprobs, strict=True)) < 1e-4
    )
    length = len(t.prompt_ids) + len(t.completion_ids)
    # every token but the last sampled one is fed exactly once
    assert cached.stats.prefill_tokens + cached.stats.decode_tokens == length - 1
    assert naive.stats.prefill_tokens + naive.stats.decode_tokens > 1.5 * length


def test_repeated_prompt_recomputes_only_the_last_token(torch_engine: Any, arun: Any, tokenizer: Any) -> None:
    engine = fresh(torch_engine)
    ids = tokenizer.encode("a shared prefix of some length", add_special_tokens=False)
    first = arun(engine.generate(ids, SamplingParams(max_tokens=3, seed=0)))
    assert engine.stats.prefill_tokens == len(ids)
    again = arun(engine.generate(ids, SamplingParams(max_tokens=3, seed=0)))
    assert engine.stats.prefill_tokens == len(ids) + 1
    assert engine.stats.cached_tokens == len(ids) - 1
    assert first[0].cached_tokens == 0 and again[0].cached_tokens == len(ids) - 1  # per request


def test_a_branch_copies_the_shared_prefix_and_keeps_the_original(
    torch_engine: Any, arun: Any, tokenizer: Any
) -> None:
    engine = fresh(torch_engine)
    a = tokenizer.encode("common stem then branch one", add_special_tokens=False)
    b = a[:12] + tokenizer.encode("xyz", add_special_tokens=False)
    arun(engine.generate(a, SamplingParams(max_tokens=2, seed=0)))
    arun(engine.generate(b, SamplingParams(max_tokens=2, seed=0)))
    assert engine.stats.prefill_tokens == len(a) + 3  # b reused the 12-token stem
    arun(engine.generate(a, SamplingParams(max_tokens=2, seed=0)))
    assert engine.stats.prefill_tokens == len(a) + 3 + 1  # a's entry survived b's branch


def test_n_samples_share_one_prefill_and_reset_drops_the_cache(
    torch_engine: Any, arun: Any, tokenizer: Any
) -> None:
    engine = fresh(torch_engine)
    ids = tokenizer.encode("four samples", add_special_tokens=False)
    arun(engine.generate(ids, SamplingParams(n=4, max_tokens=5, seed=0)))
    assert engine.stats.prefill_tokens == len(ids)
    arun(engine.reset_cache())
    arun(engine.generate(ids, SamplingParams(max_tokens=5, seed=0)))
    assert engine.stats.prefill_tokens == 2 * len(ids)


def test_loom_engine_reports_cached_prompt_tokens(
    vllm_engine: Any, engine_server: str, arun: Any, tokenizer: Any
) -> None:
    ids = tokenizer.encode("served prefix cache check", add_special_tokens=False)
    arun(vllm_engine.reset_cache())
    before = httpx.get(f"{engine_server}/loom/stats").json()
    arun(vllm_engine.generate(ids, SamplingParams(max_tokens=3, seed=0)))
    arun(vllm_engine.generate(ids, SamplingParams(max_tokens=3, seed=0)))
    after = httpx.get(f"{engine_server}/loom/stats").json()
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(ids) + 1
    assert after["cached_tokens"] - before["cached_tokens"] == len(ids) - 1


def test_loom_engine_reports_each_requests_own_cached_tokens(engine_server: str, tokenizer: Any) -> None:
    """usage.prompt_tokens_details.cached_tokens was the engine's counter difference over the call, so
    a request reported the cache hits of requests batched beside it."""
    from concurrent.futures import ThreadPoolExecutor

    long = tokenizer.encode("a long prefix the cache will hold " * 4, add_special_tokens=False)
    short = tokenizer.encode("xq", add_special_tokens=False) + [7, 9]

    def post(ids: list[int]) -> int:
        body = {"prompt": ids, "max_tokens": 4, "seed": 1}
        r = httpx.post(f"{engine_server}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    httpx.post(f"{engine_server}/reset_prefix_cache", timeout=30)
    post(long)  # now cached
    with ThreadPoolExecutor(6) as pool:
        longs = [pool.submit(post, long) for _ in range(5)]
        mine = pool.submit(post, short)
        assert all(f.result() == len(long) - 1 for f in longs)
        assert mine.result() < len(short)
