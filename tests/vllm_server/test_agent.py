"""agent mode on the real vLLM (CPU build): the first turn is a forced tool call (its ids written by
the test), the turn after the observation is vLLM's own decode. The episode is the exact
concatenation policy + observation + policy, observations carry env_mask 0, and vLLM's behaviour
log-probs on the trained tokens are the learner's teacher-forced pass over the whole multi-turn
sequence (docs/algorithms.md §2.5)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from loom.contracts.modes import parse_mode_params
from loom.contracts.wire import RolloutRequest, SamplingParams
from loom.formats import ends_with
from rollout_svc.engines.base import Completion
from rollout_svc.engines.vllm import VLLMEngine
from rollout_svc.modes.agent import Agent
from tests.vllm_server.conftest import TINY, max_diff, reference_logprobs

ATOL = 1e-4
PROMPT = "Q: what is 2+3? use the calculator.\n"
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


@pytest.fixture
def engine(vllm: Any, arun: Any) -> Iterator[VLLMEngine]:
    e = VLLMEngine(vllm.ensure("raw"), retries=1)
    yield e
    arun(e.close())


def test_an_agent_episode_on_vllm_is_exact(engine: VLLMEngine, tokenizer: Any, arun: Any) -> None:
    request = RolloutRequest(
        mode="agent",
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=32, temperature=0.0, n=1),
        mode_params={"max_turns": 2},
    )
    agent = Agent(request, engine, tokenizer, parse_mode_params(request))  # type: ignore[arg-type]
    real = agent.policy(0)

    async def turn(ids: list[int], max_tokens: int, k: int) -> Completion:
        if k > 0:
            return await real(ids, max_tokens, k)
        toks = agent.encode(CALC)
        assert ends_with(toks, agent.close_ids)
        return Completion(toks, [0.0] * len(toks), "stop", agent.syntax.call_close)

    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    ep = arun(agent.episode(prompt_ids, turn))
    first, obs, last = ep.segments
    assert (first.kind, obs.kind, last.kind) == ("turn", "observation", "turn")
    assert first.meta["status"] == "ok" and ep.tool_calls == 1 and ep.turns == 2
    want_obs = tokenizer.encode("\n<tool_response>\n5\n</tool_response>\n", add_special_tokens=False)
    assert ep.ids[obs.start : obs.end] == want_obs
    assert ep.ids == agent.encode(CALC) + want_obs + ep.ids[last.start :]
    assert last.end == len(ep.ids) > last.start  # vLLM decoded a non-empty last turn
    assert ep.mask == [0 if obs.start <= i < obs.end else 1 for i in range(len(ep.ids))]
    assert ep.stop in {"max_turns", "no_tool_call", "max_turn_tokens"}
    # vLLM's tokens, decoded after the observation, against a teacher-forced pass of the same weights
    ref = reference_logprobs(TINY, prompt_ids, ep.ids)
    own = range(last.start, last.end)
    assert max_diff([ep.logprobs[i] for i in own], [ref[i] for i in own]) < ATOL


def test_a_text_stop_keeps_the_marker_ids_the_agent_detects_a_call_by(
    engine: VLLMEngine, tokenizer: Any, arun: Any
) -> None:
    """vLLM stops on a several-token close tag by text (it has no id-sequence stops), with
    ``include_stop_str_in_output`` off; the sampled ids still end with the stop text's tokens, so the
    mode's ``ends_with(token_ids, close_ids)`` sees the call exactly as on the torch engine."""
    ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    (greedy,) = arun(engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0)))
    marker = greedy.token_ids[5:9]
    stop = tokenizer.decode(marker)
    (c,) = arun(engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])))
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == greedy.token_ids[:9] and ends_with(c.token_ids, marker)
    assert c.logprobs == pytest.approx(greedy.logprobs[:9], abs=ATOL)
