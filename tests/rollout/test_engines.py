"""Engine contract, run on the torch engine in-process, in its own process (ProcessEngine) AND on the
vllm client against `loom engine`.

Token exactness: every reported log-prob equals the log-prob of the same token in ONE teacher-forced
forward pass of the same weights over prompt + completion. Tolerance: 1e-4 absolute (float32; the
incremental KV-cache path and the full pass differ only by summation order, ~1e-6 observed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import Layout, UnsupportedCapability
from rollout_svc.engines.torch import teacher_forced_logprobs

ATOL = 1e-4


def prompt(tokenizer: Any, text: str = "what is 12+30?") -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_plain_tokens_and_logprobs_match_teacher_forced_pass(
    engine: Any, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    ids = prompt(tokenizer)
    outs = arun(engine.generate(ids, SamplingParams(n=3, max_tokens=24, seed=7, temperature=1.0)))
    assert len(outs) == 3
    for c in outs:
        assert 1 <= len(c.token_ids) <= 24 and len(c.logprobs) == len(c.token_ids)
        ref = teacher_forced_logprobs(reference_model, ids + c.token_ids, len(ids))
        assert c.logprobs == pytest.approx(ref, abs=ATOL)
        if c.finish_reason == "length":
            assert len(c.token_ids) == 24
    assert len({tuple(c.token_ids) for c in outs}) > 1  # n samples are not copies of one


def test_same_seed_same_tokens_other_seed_other_tokens(engine: Any, arun: Any, tokenizer: Any) -> None:
    ids = prompt(tokenizer, "seeds")
    a = arun(engine.generate(ids, SamplingParams(n=2, max_tokens=16, seed=1)))
    b = arun(engine.generate(ids, SamplingParams(n=2, max_tokens=16, seed=1)))
    c = arun(engine.generate(ids, SamplingParams(n=2, max_tokens=16, seed=2)))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_greedy_picks_the_argmax_of_the_reference_pass(
    engine: Any, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    ids = prompt(tokenizer, "greedy")
    (c,) = arun(engine.generate(ids, SamplingParams(max_tokens=12, temperature=0.0)))
    seq = ids + c.token_ids
    with torch.no_grad():
        logits = reference_model(torch.tensor([seq], device=reference_model.device)).logits[0]
    expected = logits[len(ids) - 1 : len(seq) - 1].argmax(-1).tolist()
    assert c.token_ids == expected[: len(c.token_ids)]


def test_stop_token_ids_end_the_sample_and_are_reported(engine: Any, arun: Any, tokenizer: Any) -> None:
    ids = prompt(tokenizer, "stop")
    stops = list(range(3, 40))  # most of the vocabulary: every sample stops early
    outs = arun(engine.generate(ids, SamplingParams(n=4, max_tokens=64, seed=3, stop_token_ids=stops)))
    for c in outs:
        assert c.finish_reason == "stop"
        assert c.stop_reason == c.token_ids[-1] and c.token_ids[-1] in stops
        assert not set(c.token_ids[:-1]) & set(stops)


def test_stop_string_ends_the_sample(engine: Any, arun: Any, tokenizer: Any) -> None:
    ids = prompt(tokenizer, "strings")
    stop = list("ae01")  # vLLM 0.32 takes at most 4 stop strings (VLLM_MAX_STOP_STRINGS), as loom engine
    outs = arun(engine.generate(ids, SamplingParams(n=4, max_tokens=64, seed=5, stop=stop)))
    for c in outs:
        if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
            text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
            assert c.stop_reason in stop and text.endswith(c.stop_reason)
            assert not any(s in text[:-1] for s in stop)
    assert any(isinstance(c.stop_reason, str) for c in outs)


def test_top_logprobs_include_the_sampled_token_and_the_best(
    engine: Any, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    ids = prompt(tokenizer, "topk")
    (c,) = arun(engine.generate(ids, SamplingParams(max_tokens=8, seed=11, logprobs=3)))
    assert c.top_logprobs is not None and len(c.top_logprobs) == len(c.token_ids)
    seq = ids + c.token_ids
    with torch.no_grad():
        logp = torch.log_softmax(
            reference_model(torch.tensor([seq], device=reference_model.device)).logits[0].float(), -1
        )
    for i, (t, top) in enumerate(zip(c.token_ids, c.top_logprobs, strict=True)):
        assert top[t] == pytest.approx(c.logprobs[i], abs=ATOL)
        best = logp[len(ids) - 1 + i].topk(3)
        for tid, lp in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            assert top[tid] == pytest.approx(lp, abs=ATOL)


def test_group_positions_are_a_torch_engine_capability(engine: Any, arun: Any, tokenizer: Any) -> None:
    ids = prompt(tokenizer)
    layout = Layout(groups=[0] * len(ids), gen_group=1)
    if engine.name == "vllm":
        with pytest.raises(UnsupportedCapability, match="group_positions"):
            arun(engine.generate(ids, SamplingParams(max_tokens=4), layout))
    else:
        (c,) = arun(engine.generate(ids, SamplingParams(max_tokens=4, seed=0), layout))
        assert len(c.token_ids) == 4


def test_group_layout_logprobs_match_teacher_forced_pass(
    local_engine: Any, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    src = prompt(tokenizer, "q: add")
    tgt = prompt(tokenizer, "a=1")
    more = prompt(tokenizer, " b is 2.")
    ids = src + tgt + more
    layout = Layout(groups=[0] * len(src) + [1] * len(tgt) + [0] * len(more), gen_group=1)
    outs = arun(local_engine.generate(ids, SamplingParams(n=2, max_tokens=16, seed=4), layout))
    for c in outs:
        ref = teacher_forced_logprobs(reference_model, ids + c.token_ids, len(ids), layout)
        assert c.logprobs == pytest.approx(ref, abs=ATOL)
        plain_ref = teacher_forced_logprobs(reference_model, ids + c.token_ids, len(ids))
        assert c.logprobs != pytest.approx(plain_ref, abs=ATOL)  # the layout really changes the model's view


def test_the_context_caps_generation_and_refuses_prompts_it_cannot_hold(local_engine: Any, arun: Any) -> None:
    """Batched and single-request (layout) paths alike; the typed error crosses the process pipe."""
    from rollout_svc.engines.base import InvalidPrompt

    limit = local_engine.max_model_len
    assert limit == 1024 and local_engine.vocab_size > 0  # the test model's config
    ids = [5] * (limit - 2)
    params = SamplingParams(n=3, max_tokens=8, seed=4)
    for layout in (None, Layout(groups=[0] * len(ids), gen_group=0)):
        outs = arun(local_engine.generate(ids, params, layout))
        assert all(len(c.token_ids) <= 2 for c in outs)
        assert all(c.finish_reason == "length" for c in outs if len(c.token_ids) == 2)
    with pytest.raises(InvalidPrompt, match=f"context holds {limit}") as e:
        arun(local_engine.generate([5] * limit, params))
    assert e.value.field == "prompt_ids"
    for bad in (-1, local_engine.vocab_size, 10**30):
        with pytest.raises(InvalidPrompt, match=r"prompt_ids\[1\] = .* outside the model's vocabulary"):
            arun(local_engine.generate([5, bad], params))
    assert len(arun(local_engine.generate([5, 6], SamplingParams(max_tokens=2, seed=1)))) == 1


def test_loom_engine_refuses_a_prompt_the_model_cannot_read_with_400(vllm_engine: Any, arun: Any) -> None:
    """The server's 400 is the vllm client's EngineRequestError (422 at the API, never retried);
    generation past the context is capped there too, as on the torch engine in-process."""
    from rollout_svc.engines.base import EngineRequestError

    with pytest.raises(EngineRequestError, match="HTTP 400.*vocabulary"):
        arun(vllm_engine.generate([99999], SamplingParams(max_tokens=2)))
    # a prompt that fills the context leaves no room for one token: vLLM 0.32 says so in these words
    with pytest.raises(EngineRequestError, match="HTTP 400.*max_tokens must be at least 1, got 0"):
        arun(vllm_engine.generate([5] * 1024, SamplingParams(max_tokens=2)))
    outs = arun(vllm_engine.generate([5] * 1022, SamplingParams(n=2, max_tokens=8, seed=4)))
    assert all(len(c.token_ids) <= 2 for c in outs)
