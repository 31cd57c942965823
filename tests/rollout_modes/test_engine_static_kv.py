"""The torch engine's static KV cache (rollout_svc/engines/torch/kv.py) and its decode step
(decode.py), on Loom's tiny model: rows joining a running batch (shorter and longer prompts than the
batch is wide, so the used columns move and the buffers grow), rows leaving in the middle, all
token-exact against each request decoded alone and the teacher-forced pass, in the eager step and in
the static-shape step a CUDA graph captures (run uncaptured here); and the buffers' bookkeeping
against the DynamicCache surgery it replaced."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest
import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Completion, Progress
from rollout_svc.engines.torch import TorchEngine, prefix_cache, teacher_forced_logprobs
from rollout_svc.engines.torch.kv import StaticKv, allocate, row_bucket
from rollout_svc.engines.torch.scheduler import _fill_holes
from zoo.tiny import child_prompt, make_problems, spawn_prompt

ATOL = 1e-4
TIMEOUT = 120


def make(tiny_engine: Any, mode: str, **kwargs: Any) -> TorchEngine:
    engine = TorchEngine(
        tiny_engine.model_path, tokenizer=tiny_engine.tokenizer, model=tiny_engine.model, **kwargs
    )
    engine.scheduler.decode.mode = mode  # type: ignore[assignment]
    return engine


def encode(engine: Any, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def staggered(
    engine: TorchEngine,
    first: list[tuple[list[int], SamplingParams]],
    later: dict[int, list[tuple[list[int], SamplingParams]]],
) -> list[list[Completion]]:
    """Start the ``first`` requests in one batch; when the first of them has sampled ``t`` tokens
    submit the requests ``later[t]`` (from the scheduler's own thread: they join the running batch
    at its next step)."""
    futures: list[Future[list[Completion]]] = []

    def listener(p: Progress) -> None:
        if p.sample == 0:
            futures.extend(engine._submit(ids, params) for ids, params in later.get(p.tokens, []))

    with engine._exclusive():  # every first request pending before the scheduler starts
        futures.append(engine._submit(*first[0], listener))
        futures.extend(engine._submit(ids, params) for ids, params in first[1:])
    done = [f.result(timeout=TIMEOUT) for f in futures[: len(first)]]
    return done + [f.result(timeout=TIMEOUT) for f in futures[len(first) :]]


def test_cuda_graphs_are_never_used_on_cpu(tiny_engine: Any) -> None:
    engine = TorchEngine(tiny_engine.model_path, model=tiny_engine.model, cuda_graphs=True)
    assert not engine.cuda_graphs and engine.scheduler.decode.mode == "eager"


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_rows_joining_and_leaving_a_running_batch_stay_token_exact(tiny_engine: Any, mode: str) -> None:
    engine = make(tiny_engine, mode, cache_entries=8)
    serial = TorchEngine(
        tiny_engine.model_path, tokenizer=tiny_engine.tokenizer, model=tiny_engine.model, batching=False
    )
    probs = make_problems("countdown", 2, seed=7)
    texts = [child_prompt("7*4=28 24:[28,3,1]"), "[child] 3 12", spawn_prompt(probs[0])]
    short, middle, longer = sorted((encode(engine, t) for t in texts), key=len)
    assert len(short) < len(middle) < len(longer)
    first = [  # room for the first joiner; the second row leaves before it comes, a free row
        (short, SamplingParams(max_tokens=100, temperature=0.0)),
        (middle, SamplingParams(max_tokens=2, temperature=0.0)),
    ]
    wider = (longer, SamplingParams(max_tokens=40, temperature=0.0))  # wider than the batch: columns move
    later = [
        (short, SamplingParams(max_tokens=12, temperature=1.0, seed=4, n=3)),  # leaves early, rows differ
        (middle, SamplingParams(max_tokens=90, seed=9, n=2, logprobs=2)),
        (encode(engine, spawn_prompt(probs[1])), SamplingParams(max_tokens=160, temperature=0.0)),  # grows
    ]
    assert len(longer) > len(short) + 3
    got = staggered(engine, first, {3: [wider], 6: later})
    calls = [*first, wider, *later]
    want = [serial.generate_sync(ids, params) for ids, params in calls]
    assert [[c.token_ids for c in o] for o in got] == [[c.token_ids for c in o] for o in want]
    for (ids, _), outs in zip(calls, got, strict=True):
        for c in outs:
            ref = teacher_forced_logprobs(tiny_engine.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=ATOL)
    assert engine.stats.extra["peak_batch_requests"] == 5  # they really shared the batch
    kv = engine.scheduler.kv
    assert kv is not None and kv.moves >= 1 and kv.generation >= 1  # columns moved, buffers grew
    # the finished rows left exact prefix-cache entries: a continuation reuses them
    c = got[2][0]
    again = engine.generate_sync(longer + c.token_ids[:-1], SamplingParams(max_tokens=5, temperature=0.0))
    assert again[0].cached_tokens == len(longer) + len(c.token_ids) - 2
    ref = serial.generate_sync(longer + c.token_ids[:-1], SamplingParams(max_tokens=5, temperature=0.0))
    assert again[0].token_ids == ref[0].token_ids
    engine.stop_scheduler()
    serial.stop_scheduler()


def test_the_static_cache_holds_what_the_dynamic_cache_surgery_held() -> None:
    """Rows added at different widths, a step written, a row dropped, columns dropped: every row's
    real columns equal what ``prefix_cache.merge`` / ``batch_select_indices`` / ``drop_left`` give."""
    g = torch.Generator().manual_seed(0)

    def block(rows: int, width: int) -> tuple[Any, torch.Tensor]:
        k = torch.randn(rows, 2, width, 4, generator=g)
        return prefix_cache.dynamic_cache([(k, k * 2), (k + 1, k - 1)]), torch.ones(
            rows, width, dtype=torch.long
        )

    a, a_mask = block(2, 5)
    a_mask[1, :2] = 0  # row 1 is left-padded
    b, b_mask = block(3, 9)  # wider than the batch
    kv = allocate(None, a, 2, 5, room=4)
    kv.add(a, a_mask, room=4)
    kv = allocate(kv, b, 5, 9, room=4)
    kv.add(b, b_mask, room=4)
    want = prefix_cache.merge(a, 5, b, 9)
    for (wk, wv), k, v in zip(prefix_cache.layers(want), kv.keys, kv.values, strict=True):
        assert torch.equal(k[:5, :, kv.start : kv.end], wk) and torch.equal(v[:5, :, kv.start : kv.end], wv)
    lengths = [5, 3, 9, 9, 9]
    assert kv.mask[:5, kv.start : kv.end].sum(dim=1).tolist() == lengths
    # one step: every row writes column ``end``
    step = [torch.randn(5, 2, 1, 4, generator=g) for _ in range(2)]
    mask = kv.step_mask()
    assert mask.shape == (5, 1, 1, 10) and bool(mask[:, 0, 0, -1].all())
    for i, s in enumerate(step):
        kv.write(i, s, s)
    kv.advance()
    # rows 1 and 3 leave: row 4 takes row 1's place, then the all-padding columns go
    order = _fill_holes(5, {1, 3})
    assert order == [0, 4, 2]
    kv.keep(order)
    kv.drop_left(10)
    assert kv.rows == 3 and kv.end - kv.start == 10
    for i, (wk, wv) in enumerate(prefix_cache.layers(want)):
        assert torch.equal(kv.keys[i][:3, :, kv.start : kv.end], torch.cat([wk, step[i]], dim=2)[order])
        assert torch.equal(kv.values[i][:3, :, kv.start : kv.end], torch.cat([wv, step[i]], dim=2)[order])
    row = prefix_cache.layers(kv.row(2, 4))[0][0]
    assert torch.equal(row, torch.cat([prefix_cache.layers(want)[0][0], step[0]], dim=2)[2:3, :, -4:])
    assert kv.mask[:3, kv.start : kv.end].sum(dim=1).tolist() == [6, 10, 10]


def test_leavers_places_are_filled_from_the_end() -> None:
    assert _fill_holes(6, {5}) == [0, 1, 2, 3, 4]  # the last row leaves: nothing moves
    assert _fill_holes(6, {0, 4}) == [5, 1, 2, 3]
    assert _fill_holes(4, {0, 1, 2, 3}) == []


def test_row_buckets_are_powers_of_two_then_steps_of_32() -> None:
    assert [row_bucket(n) for n in (1, 2, 3, 5, 17, 32, 33, 64, 65, 100)] == [
        1,
        2,
        4,
        8,
        32,
        32,
        64,
        64,
        96,
        128,
    ]


def test_a_full_step_keeps_the_unused_columns_and_rows_out() -> None:
    """The static-shape mask: every column, the padding rows open (no all-masked softmax row)."""
    k = torch.zeros(3, 1, 4, 2)
    cache = prefix_cache.dynamic_cache([(k, k)])
    kv = StaticKv(prefix_cache.layers(cache), 4, 64)
    kv.add(cache, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]]), room=8)
    kv.full = True
    mask = kv.step_mask()
    assert mask.shape == (4, 1, 1, 64)
    assert mask[:3, 0, 0].sum(dim=1).tolist() == [4, 5, 3]  # the real tokens and the step's column
