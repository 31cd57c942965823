"""Batching in the torch engine, on Loom's tiny model: concurrent requests decoded in one batch give
the tokens each request gives alone (greedy and seeded sampling), token-exact log-probs, their own
stops, prefix-cache entries; errors reach only the request that caused them, and nothing hangs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from loom.contracts.wire import SamplingParams
from loom.formats import DEFAULT_SPAWN
from rollout_svc.engines.base import Completion, Layout
from rollout_svc.engines.torch import TorchEngine, teacher_forced_logprobs
from zoo.tiny import child_prompt, make_problems, spawn_prompt

ATOL = 1e-4
TIMEOUT = 120  # seconds: a hang fails the test instead of blocking the suite


def make(tiny_engine: Any, **kwargs: Any) -> TorchEngine:
    kwargs.setdefault("cache_entries", 0)
    kwargs.setdefault("model", tiny_engine.model)
    return TorchEngine(tiny_engine.model_path, tokenizer=tiny_engine.tokenizer, **kwargs)


def encode(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def prompts(engine: Any) -> list[list[int]]:
    """Prompts of different lengths: spawn prompts, child prompts, a short one."""
    probs = make_problems("countdown", 3, seed=5)
    texts = [spawn_prompt(p) for p in probs[:2]]
    texts += [child_prompt("9+5=14 11:[7,14]"), child_prompt("7*4=28 24:[28,3,1]"), "[child] 3"]
    out = [encode(engine, t) for t in texts]
    assert len({len(p) for p in out}) >= 3
    return out


def submit_together(engine: TorchEngine, calls: list[tuple[list[int], SamplingParams]]) -> list[Future[Any]]:
    """Every request is pending before the scheduler starts: they all enter the first batch."""
    with engine._exclusive():
        return [engine._submit(ids, params) for ids, params in calls]


def together(engine: TorchEngine, calls: list[tuple[list[int], SamplingParams]]) -> list[list[Completion]]:
    return [f.result(timeout=TIMEOUT) for f in submit_together(engine, calls)]


def alone(engine: TorchEngine, calls: list[tuple[list[int], SamplingParams]]) -> list[list[Completion]]:
    return [engine.generate_sync(ids, params) for ids, params in calls]


def tokens(outs: list[list[Completion]]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o] for o in outs]


def test_greedy_batch_gives_each_request_its_own_tokens_and_exact_logprobs(tiny_engine: Any) -> None:
    batched, serial = make(tiny_engine), make(tiny_engine, batching=False)
    calls = [
        (ids, SamplingParams(max_tokens=48, temperature=0.0, n=1 + (k == 1)))
        for k, ids in enumerate(prompts(batched))
    ]
    got = together(batched, calls)
    want = alone(serial, calls)
    assert tokens(got) == tokens(want)
    assert [[c.finish_reason for c in o] for o in got] == [[c.finish_reason for c in o] for o in want]
    for (ids, _), outs in zip(calls, got, strict=True):
        for c in outs:
            ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=ATOL)
    # the batch really was one batch: every request and every row in one forward
    extra = batched.stats.extra
    assert extra["peak_batch_requests"] == len(calls) and extra["peak_batch_rows"] == len(calls) + 1
    assert extra["batched_steps"] >= 1
    assert serial.stats.extra["decode_steps"] == 0  # batching off: the single-request path
    assert batched.stats.decode_tokens == serial.stats.decode_tokens
    assert batched.stats.prefill_tokens == serial.stats.prefill_tokens == sum(len(ids) for ids, _ in calls)


@pytest.mark.parametrize(
    "knobs", [{"temperature": 1.0}, {"temperature": 0.8, "top_k": 20}, {"temperature": 1.2, "top_p": 0.9}]
)
def test_seeded_samples_do_not_depend_on_batch_mates(tiny_engine: Any, knobs: dict[str, Any]) -> None:
    batched, serial = make(tiny_engine), make(tiny_engine, batching=False)
    ps = prompts(batched)
    calls = [
        (ids, SamplingParams(max_tokens=40, seed=10 + k, n=2, logprobs=2, **knobs))
        for k, ids in enumerate(ps)
    ]
    want = alone(serial, calls)
    got = together(batched, calls)
    assert tokens(got) == tokens(want)
    # other batch mates (reversed order, one request missing, a greedy stranger): the same samples
    mates = [*calls[:0:-1], (ps[0], SamplingParams(max_tokens=30, temperature=0.0))]
    assert tokens(together(batched, mates)[:-1]) == tokens(want[:0:-1])
    for (ids, _), outs_got, outs_want in zip(calls, got, want, strict=True):
        for c, w in zip(outs_got, outs_want, strict=True):
            assert c.logprobs == pytest.approx(w.logprobs, abs=ATOL)
            assert c.top_logprobs is not None and w.top_logprobs is not None
            for a, b in zip(c.top_logprobs, w.top_logprobs, strict=True):
                assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=ATOL)
            ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=ATOL)
    assert len({tuple(c.token_ids) for o in got for c in o}) > len(calls)  # really sampled


def test_every_row_stops_on_its_own_terms(tiny_engine: Any) -> None:
    batched, serial = make(tiny_engine), make(tiny_engine, batching=False)
    tok = batched.tokenizer
    spawn_ids, other_spawn, child_ids, short_ids = prompts(batched)[:4]
    close_id = tok.convert_tokens_to_ids(DEFAULT_SPAWN.spawn_close)
    calls = [
        (spawn_ids, SamplingParams(max_tokens=200, temperature=0.0, stop_token_ids=[close_id])),  # stop token
        (child_ids, SamplingParams(max_tokens=200, temperature=0.0)),  # ends at EOS
        (other_spawn, SamplingParams(max_tokens=200, temperature=0.0, stop=["Node #"])),  # stop string
        (short_ids, SamplingParams(max_tokens=7, temperature=0.0)),  # length
        (child_ids, SamplingParams(max_tokens=60, temperature=1.0, seed=4, n=3, stop=["no"])),  # rows differ
    ]
    got = together(batched, calls)
    want = alone(serial, calls)
    assert tokens(got) == tokens(want)
    reasons = [[(c.finish_reason, c.stop_reason) for c in o] for o in got]
    assert reasons == [[(c.finish_reason, c.stop_reason) for c in o] for o in want]
    (a,), (b,), (c,), (d,), rows = got
    assert (a.finish_reason, a.stop_reason, a.token_ids[-1]) == ("stop", close_id, close_id)
    assert b.finish_reason == "stop" and b.stop_reason is None and b.token_ids[-1] in batched.eos_ids
    assert c.stop_reason == "Node #" and tok.decode(c.token_ids).endswith("Node #")
    assert (d.finish_reason, len(d.token_ids)) == ("length", 7)
    assert len({len(r.token_ids) for r in rows}) > 1  # the rows of one request ended at different steps
    assert batched.stats.extra["peak_batch_rows"] == 7


def test_finished_rows_leave_exact_prefix_cache_entries(tiny_engine: Any) -> None:
    cached, naive = make(tiny_engine, cache_entries=16), make(tiny_engine)
    ps = prompts(cached)
    calls = [(ids, SamplingParams(max_tokens=12 + 4 * k, temperature=0.0)) for k, ids in enumerate(ps)]
    first = together(cached, calls)
    # resume every sequence where it stopped: only the last sampled token is new to the model
    resumed = [
        (ids + o[0].token_ids, SamplingParams(max_tokens=10, temperature=0.0))
        for (ids, _), o in zip(calls, first, strict=True)
    ]
    before = cached.stats.prefill_tokens
    got = together(cached, resumed)
    assert cached.stats.prefill_tokens - before == len(resumed)
    assert cached.stats.cached_tokens == sum(len(ids) - 1 for ids, _ in resumed)
    assert tokens(got) == tokens(alone(naive, resumed))
    for (ids, _), (c,) in zip(resumed, got, strict=True):
        ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))
        assert c.logprobs == pytest.approx(ref, abs=ATOL)


def test_a_bad_request_fails_alone_and_nothing_hangs(
    tiny_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, serial = make(tiny_engine), make(tiny_engine, batching=False)
    ps = prompts(engine)
    good = [(ids, SamplingParams(max_tokens=20, temperature=0.0)) for ids in ps[:3]]
    want = tokens(alone(serial, good))
    # a prefill failure and a sampling failure, in one batch. Both are injected: a real bad id never
    # reaches the model (generate refuses it), and on CUDA one would end the process's CUDA context.
    real_sample, real_prefill, real_batch = engine._sample, engine._prefill_rows, engine._prefill_batch
    bad_prompt = ps[0][:3]
    batched_prefills: list[int] = []

    def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, *history: Any) -> Any:
        if params.seed == 666:
            raise RuntimeError("sampling failed")
        return real_sample(logits, params, gen, *history)

    def prefill_rows(key: list[tuple[int, int]], *args: Any) -> Any:
        if [t for t, _ in key] == bad_prompt:
            raise IndexError("prefill failed")
        return real_prefill(key, *args)

    def prefill_batch(keys: list[list[tuple[int, int]]], ns: list[int]) -> Any:
        batched_prefills.append(len(keys))
        if any([t for t, _ in key] == bad_prompt for key in keys):
            raise IndexError("prefill failed")
        return real_batch(keys, ns)

    monkeypatch.setattr(engine, "_sample", sample)
    monkeypatch.setattr(engine, "_prefill_rows", prefill_rows)
    monkeypatch.setattr(engine, "_prefill_batch", prefill_batch)
    bad_ids = (bad_prompt, SamplingParams(max_tokens=20))
    # top_k: sampled request by request (``_sample``), not with the plain rows (``sample_rows``)
    bad_sampling = (ps[1], SamplingParams(max_tokens=20, seed=666, n=2, top_k=10))
    futs = submit_together(engine, [good[0], bad_ids, good[1], bad_sampling, good[2]])
    with pytest.raises(IndexError):
        futs[1].result(timeout=TIMEOUT)
    with pytest.raises(RuntimeError, match="sampling failed"):
        futs[3].result(timeout=TIMEOUT)
    assert [[c.token_ids for c in futs[i].result(timeout=TIMEOUT)] for i in (0, 2, 4)] == want
    assert batched_prefills == [5]  # one shared prefill failed; then each request alone
    monkeypatch.undo()

    # a failed batched forward fails that batch's requests; the engine keeps serving afterwards
    class Flaky:
        def __init__(self, model: Any) -> None:
            self.model, self.armed = model, True

        def __getattr__(self, name: str) -> Any:
            return getattr(self.model, name)

        def __call__(self, ids: torch.Tensor, **kwargs: Any) -> Any:
            if self.armed and ids.shape[0] > 1:
                raise RuntimeError("forward failed")
            return self.model(ids, **kwargs)

    flaky = Flaky(tiny_engine.model)
    engine = make(tiny_engine, model=flaky)
    futs = submit_together(engine, good)
    for f in futs:
        with pytest.raises(RuntimeError, match="forward failed"):
            f.result(timeout=TIMEOUT)
    flaky.armed = False
    assert tokens(together(engine, good)) == want


def test_async_callers_layouts_and_threads_share_the_engine(tiny_engine: Any) -> None:
    engine, serial = make(tiny_engine, cache_entries=8), make(tiny_engine, batching=False)
    ps = prompts(engine)
    plain = [(ids, SamplingParams(max_tokens=24, seed=k, temperature=0.7)) for k, ids in enumerate(ps)]
    layout_ids = ps[0] + ps[2]
    layout = Layout(groups=[0] * len(ps[0]) + [1] * len(ps[2]), gen_group=1)
    lp = SamplingParams(max_tokens=16, seed=1)

    async def main() -> list[Any]:
        jobs: list[Coroutine[Any, Any, Any]] = [engine.generate(ids, p) for ids, p in plain]
        jobs.insert(2, engine.generate(layout_ids, lp, layout))
        jobs.append(engine.reset_cache())
        return await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)

    got = asyncio.run(main())
    layout_out = got.pop(2)
    got.pop()  # reset_cache
    assert tokens(got) == tokens(alone(serial, plain))
    assert [c.token_ids for c in layout_out] == [
        c.token_ids for c in serial.generate_sync(layout_ids, lp, layout)
    ]
    # generate_sync from several threads at once
    results: dict[int, list[Completion]] = {}

    def call(k: int) -> None:
        results[k] = engine.generate_sync(*plain[k])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert tokens([results[k] for k in range(len(plain))]) == tokens(got)
