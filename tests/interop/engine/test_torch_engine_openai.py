"""What the OpenAI surface needs of the torch engine, on the tiny model in-process: vLLM's logits
processors (``process_logits``), token-by-token streaming, prompt log-probs, vocabulary checks."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from loom.contracts.wire import SamplingParams
from rollout_svc.engines.base import InvalidPrompt, Progress
from rollout_svc.engines.torch import (
    TorchEngine,
    process_logits,
    resolve_model_path,
    teacher_forced_logprobs,
)

PROMPT = [61, 383, 63, 347, 223, 22, 25, 13, 26, 23, 16, 201]  # "[plain] Compute 47+85.\n"


@pytest.fixture(scope="module")
def engine() -> Iterator[TorchEngine]:
    e = TorchEngine(resolve_model_path("tiny"), cache_entries=4)
    yield e
    e.stop_scheduler()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    out = process_logits(logits, SamplingParams(repetition_penalty=2.0), [0], [[1]], set())
    # 0 is in the prompt, 1 in the output: both penalised; 2, 3, 4 were never seen
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]
    assert logits.tolist() == [[2.0, -2.0, 2.0, -2.0, 1.0]]  # the engine's logits are not touched


def test_frequency_counts_output_occurrences_and_presence_counts_once() -> None:
    logits = torch.zeros(2, 4)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0)
    out = process_logits(logits, params, [3, 3], [[1, 1, 2], []], set())
    assert out[0].tolist() == [0.0, -2.0, -1.5, 0.0]  # prompt tokens (3) are not output tokens
    assert out[1].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_min_tokens_hides_the_stop_ids_only_from_rows_still_short() -> None:
    logits = torch.zeros(2, 5)
    out = process_logits(logits, SamplingParams(min_tokens=2), [], [[4], [4, 4]], {1, 3})
    assert out[0].tolist() == [0.0, float("-inf"), 0.0, float("-inf"), 0.0]
    assert out[1].tolist() == [0.0] * 5


def test_allowed_token_ids_and_logit_bias() -> None:
    logits = torch.zeros(1, 4)
    out = process_logits(
        logits, SamplingParams(allowed_token_ids=[1, 2], logit_bias={2: 3.0}), [], [[]], set()
    )
    assert out.tolist() == [[float("-inf"), 0.0, 3.0, float("-inf")]]


def test_min_p_keeps_only_tokens_near_the_most_likely(engine: TorchEngine) -> None:
    # at min_p=1 only the most likely token survives: sampling at any temperature is greedy
    greedy = run(engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0)))[0].token_ids
    for seed in range(3):
        outs = run(
            engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=2.0, min_p=1.0, seed=seed))
        )
        assert outs[0].token_ids == greedy


def test_a_stream_gives_every_token_in_order_and_the_same_samples_as_generate(engine: TorchEngine) -> None:
    params = SamplingParams(n=3, max_tokens=16, temperature=1.0, seed=11, logprobs=2)

    async def collect() -> list[Progress]:
        return [p async for p in engine.stream(PROMPT, params)]

    events = run(collect())
    whole = run(engine.generate(PROMPT, params))
    for sample in range(3):
        mine = [p for p in events if p.sample == sample]
        assert [p.tokens for p in mine] == list(range(1, len(whole[sample].token_ids) + 1))
        assert [p.ended for p in mine] == [False] * (len(mine) - 1) + [True]
        c = mine[-1].completion
        assert c.token_ids == whole[sample].token_ids and c.finish_reason == whole[sample].finish_reason
        assert c.logprobs == pytest.approx(whole[sample].logprobs, abs=1e-5)


def test_a_stream_of_a_prompt_the_model_cannot_read_raises_before_any_token(engine: TorchEngine) -> None:
    async def first() -> Any:
        return await engine.stream([600], SamplingParams(max_tokens=2)).__anext__()

    with pytest.raises(InvalidPrompt, match="outside the model's vocabulary"):
        run(first())


def test_prompt_logprobs_are_the_teacher_forced_logprobs_with_vllms_ranks(engine: TorchEngine) -> None:
    plps = run(engine.prompt_logprobs(PROMPT, 3))
    assert plps[0] is None and len(plps) == len(PROMPT)
    want = teacher_forced_logprobs(engine.model, PROMPT, 1)
    for i, d in enumerate(plps[1:]):
        assert d is not None
        (tid, (lp, rank)), *top = d.items()
        assert tid == PROMPT[i + 1] and lp == pytest.approx(want[i], abs=1e-5) and rank >= 1
        others = [r for _, (_, r) in top]
        assert others == sorted(others) and set(others) <= {1, 2, 3} and len(d) in (3, 4)


def test_a_logit_bias_or_allowed_id_outside_the_vocabulary_is_refused_naming_the_field(
    engine: TorchEngine,
) -> None:
    for params, field in (
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
    ):
        with pytest.raises(InvalidPrompt) as e:
            run(engine.generate(PROMPT, params))
        assert e.value.field == field
