"""The torch engine's issue-37 parts on Loom's tiny model: the dtype setting (bf16 / fp16 against a
float32 teacher-forced pass, the tolerance documented in docs/benchmarks/engine.md), rows in flight
bounded by a KV-memory budget, uncached requests admitted together prefilled in one forward, and the
plain requests' rows sampled together with the tokens each request gets alone."""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import pytest
import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Layout
from rollout_svc.engines.torch import TorchEngine, teacher_forced_logprobs
from rollout_svc.engines.torch.sampling import DRAW_BLOCK, draw, is_plain, sample, sample_rows
from rollout_svc.engines.torch.scheduler import kv_bytes_per_token
from zoo.tiny import CHECKPOINT_DIR, reflect_prompt, tiny_problems

TIMEOUT = 120
# bf16 weights and KV cache against the float32 teacher-forced pass (measured on the tiny model,
# 8 prompts x 4 samples x 96 tokens: mean 1.4e-3, p99 0.031, max 0.29; fp16: 1.4e-4, 0.0023, 0.071)
BF16_MEAN, BF16_MAX = 0.01, 0.6
FP16_MEAN, FP16_MAX = 0.002, 0.2


def _prompts(engine: TorchEngine, n: int, seed: int = 3) -> list[list[int]]:
    return [
        list(engine.tokenizer.encode(reflect_prompt(p), add_special_tokens=False))
        for p in tiny_problems("arith", n, seed=seed)
    ]


def _together(engine: TorchEngine, calls: list[tuple[list[int], SamplingParams]]) -> list[Any]:
    async def go() -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*(engine.generate(i, p) for i, p in calls)), TIMEOUT)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("dtype", "mean_tol", "max_tol"), [("bfloat16", BF16_MEAN, BF16_MAX), ("float16", FP16_MEAN, FP16_MAX)]
)
def test_a_half_precision_engine_stays_within_the_measured_tolerance_of_float32(
    tiny_engine: Any, dtype: str, mean_tol: float, max_tol: float
) -> None:
    engine = TorchEngine(CHECKPOINT_DIR, cache_entries=8, dtype=dtype)  # type: ignore[arg-type]
    assert {p.dtype for p in engine.model.parameters()} == {getattr(torch, dtype)}
    assert engine.dtype == dtype
    prompts = _prompts(engine, 6)
    outs = _together(
        engine, [(ids, SamplingParams(n=2, max_tokens=64, seed=i)) for i, ids in enumerate(prompts)]
    )
    diffs = []
    for ids, completions in zip(prompts, outs, strict=True):
        for c in completions:
            ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))  # float32
            diffs += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
    assert len(diffs) > 200
    assert statistics.mean(diffs) < mean_tol and max(diffs) < max_tol
    assert max(diffs) > 0  # really another precision
    # the group layout's block mask takes the model's dtype (sdpa refuses a float32 mask there)
    tok = engine.tokenizer
    src = list(tok.encode("[stream] The first number is 12.", add_special_tokens=False))
    tgt = list(tok.encode(" a=12", add_special_tokens=False))
    layout = Layout(groups=[0] * len(src) + [1] * len(tgt), gen_group=1)
    (c,) = engine.generate_sync(src + tgt, SamplingParams(max_tokens=16, seed=1), layout)
    ref = teacher_forced_logprobs(tiny_engine.model, src + tgt + c.token_ids, len(src) + len(tgt), layout)
    assert max(abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)) < max_tol
    engine.stop_scheduler()


def test_the_kv_budget_bounds_the_rows_in_flight(tiny_engine: Any) -> None:
    per_token = kv_bytes_per_token(tiny_engine.model.config, "float32")
    assert per_token == 2 * 4 * 4 * 32 * 4  # keys and values x layers x KV heads x head dim x 4 bytes
    prompts = _prompts(tiny_engine, 8, seed=5)
    max_tokens = 24
    widest = max(len(p) for p in prompts) + max_tokens
    budget = 3 * widest * per_token  # room for three rows at the widest
    engine = TorchEngine(
        CHECKPOINT_DIR,
        model=tiny_engine.model,
        tokenizer=tiny_engine.tokenizer,
        cache_entries=0,
        kv_budget_bytes=budget,
    )
    assert engine.max_batch_rows is None  # no fixed cap: the budget decides
    calls = [(ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)) for ids in prompts]
    got = _together(engine, calls)
    assert engine.stats.extra["peak_batch_rows"] == 3
    alone = TorchEngine(
        CHECKPOINT_DIR, model=tiny_engine.model, tokenizer=tiny_engine.tokenizer, cache_entries=0
    )
    assert [o[0].token_ids for o in got] == [o[0].token_ids for o in _together(alone, calls)]
    assert alone.stats.extra["peak_batch_rows"] == len(prompts)  # the default budget holds them all
    # a request larger than the budget still runs, alone
    (big,) = _together(engine, [(prompts[0], SamplingParams(n=5, max_tokens=8, temperature=0.0))])
    assert len(big) == 5 and all(len(c.token_ids) == 8 for c in big)
    engine.stop_scheduler()
    alone.stop_scheduler()


class _Counting:
    """The real model, counting its forwards by the number of tokens per row."""

    def __init__(self, model: Any) -> None:
        self.model, self.widths = model, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, ids: torch.Tensor, **kwargs: Any) -> Any:
        self.widths.append(ids.shape[1])
        return self.model(ids, **kwargs)


def test_uncached_requests_admitted_together_share_one_prefill_forward(tiny_engine: Any) -> None:
    counting = _Counting(tiny_engine.model)
    engine = TorchEngine(CHECKPOINT_DIR, model=counting, tokenizer=tiny_engine.tokenizer, cache_entries=0)
    prompts = _prompts(tiny_engine, 5, seed=7)
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised
    with engine._exclusive():  # every request pending before the scheduler starts
        futs = [
            engine._submit(ids, SamplingParams(n=2, max_tokens=12, seed=i)) for i, ids in enumerate(prompts)
        ]
    outs = [f.result(timeout=TIMEOUT) for f in futs]
    prefills = [w for w in counting.widths if w > 1]
    assert prefills == [max(len(p) for p in prompts)]  # one forward for the five prompts
    assert engine.stats.prefill_tokens == sum(len(p) for p in prompts)
    for ids, completions in zip(prompts, outs, strict=True):
        for c in completions:
            ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=1e-4)
    engine.stop_scheduler()


def test_requests_one_gather_submits_are_admitted_as_one_burst(tiny_engine: Any) -> None:
    """An event loop's calls in one turn reach the scheduler together (``Scheduler.submit`` stages
    them): one prefill forward, every row decoded in step, token-exact."""
    counting = _Counting(tiny_engine.model)
    engine = TorchEngine(CHECKPOINT_DIR, model=counting, tokenizer=tiny_engine.tokenizer, cache_entries=0)
    prompts = _prompts(tiny_engine, 12, seed=11)
    for round_ in range(2):  # a fresh scheduler thread, then the one left idle by the first round
        counting.widths.clear()
        steps = engine.stats.extra["decode_steps"]
        params = [SamplingParams(max_tokens=10, seed=i, ignore_eos=True) for i in range(len(prompts))]
        outs = _together(engine, list(zip(prompts, params, strict=True)))
        assert [w for w in counting.widths if w > 1] == [max(len(p) for p in prompts)], round_
        assert engine.stats.extra["decode_steps"] - steps == 9  # 10 tokens: 9 forwards after the prefill
        for ids, (c,) in zip(prompts, outs, strict=True):
            ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=1e-4)
    engine.stop_scheduler()


def test_unit_temperatures_skip_the_second_softmax_exactly() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 40) * 2
    temps = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    for mode in ("raw", "processed"):
        got, want = (
            sample_rows(logits, temps, [(torch.Generator().manual_seed(5), 1, 3)], mode, unit)  # type: ignore[arg-type]
            for unit in (True, False)
        )
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_plain_rows_sampled_together_draw_what_each_request_draws_alone() -> None:
    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 3
    temps = [0.0, 0.0, 0.7, 0.7, 0.7, 1.0, 1.3]  # a greedy request (2 rows), then three sampled ones
    spans = [(0, 2), (2, 5), (5, 6), (6, 7)]
    for mode in ("raw", "processed"):
        gens = [torch.Generator().manual_seed(10 + i) for i in range(len(spans))]
        draws = [(gens[i], a, b) for i, (a, b) in enumerate(spans) if temps[a] > 0]
        tokens, lps, _ = sample_rows(logits, torch.tensor(temps), draws, mode)  # type: ignore[arg-type]
        for i, (a, b) in enumerate(spans):
            params = SamplingParams(temperature=temps[a])
            assert is_plain(params)
            want, want_lp, _ = sample(logits[a:b], params, torch.Generator().manual_seed(10 + i), mode, set())  # type: ignore[arg-type]
            assert tokens[a:b].tolist() == want.tolist()
            assert lps[a:b].tolist() == pytest.approx(want_lp.tolist(), abs=1e-6)
    # a seeded request samples the same tokens again
    again = [
        sample(logits, SamplingParams(temperature=1.0), torch.Generator().manual_seed(4), "raw", set())[0]
        for _ in range(2)
    ]
    assert again[0].tolist() == again[1].tolist()
    assert not is_plain(SamplingParams(top_k=5)) and not is_plain(SamplingParams(repetition_penalty=1.1))


@pytest.mark.parametrize("vocab", [700, 3 * DRAW_BLOCK + 500])
def test_draw_is_the_categorical_and_never_a_zero(vocab: int) -> None:
    """``draw`` (one uniform a row, two levels past ``DRAW_BLOCK`` entries): 160k seeded draws match
    the distribution within 5 standard errors on every token; tokens of probability 0 (the first,
    the last, at block edges) are never drawn; rows drawn apart draw what they draw together."""
    g = torch.Generator().manual_seed(0)
    p = torch.rand(vocab, generator=g) ** 8  # many small entries, a few large
    p[torch.randperm(vocab, generator=g)[:3]] += 20.0  # heavy tokens
    zero = [0, vocab - 1, *[b for b in (DRAW_BLOCK - 1, DRAW_BLOCK, 2 * DRAW_BLOCK) if b < vocab - 1]]
    p[zero] = 0.0
    p /= p.sum()
    probs = p.expand(4000, vocab).contiguous()
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for _ in range(40):
        counts += torch.bincount(draw(probs, [(gen, 0, 4000)]), minlength=vocab).double()
    n = counts.sum()
    assert n == 160_000 and counts[zero].sum() == 0
    q = p.double()
    bound = 5 * (q * (1 - q) / n).sqrt() + 1 / n
    assert bool(((counts / n - q).abs() <= bound).all())
    # the rows of several generators: each span as it is alone; rows no generator owns draw u = 0
    spans = [(torch.Generator().manual_seed(7), 1, 5), (torch.Generator().manual_seed(8), 6, 9)]
    together = draw(probs[:10], spans)
    for (_, a, b), seed in zip(spans, (7, 8), strict=True):
        alone = draw(probs[a:b], [(torch.Generator().manual_seed(seed), 0, b - a)])
        assert together[a:b].tolist() == alone.tolist()
    first_positive = int((p > 0).nonzero()[0])
    assert together[[0, 5, 9]].tolist() == [first_positive] * 3
