"""The ``openai`` client (3.x, from PyPI) against ``loom engine --model tiny`` started as a server:
completions, chat, batched prompts, streams, vLLM's extra fields, errors as the client raises them;
and the same client against the rollout service's ``/engine/v1``.

Greedy answers are compared with what a real vLLM 0.32 answered (vllm_0.32_tiny.json).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

A = "[plain] Compute 47+85.\n"
B = "[plain] Compute 1+1.\n"
CHAT = [{"role": "user", "content": "[plain] Compute 47+85."}]
RECORDED = json.loads(Path(__file__).with_name("vllm_0.32_tiny.json").read_text())


def recorded(section: str, name: str) -> dict[str, Any]:
    return RECORDED[section][name]["response"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def client(loom_engine: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{loom_engine}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def greedy_text(client: OpenAI, prompt: str, max_tokens: int = 40) -> str:
    return (
        client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
        .choices[0]
        .text
    )


def test_a_completion_is_vllms_greedy_answer(client: OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=A, max_tokens=24, temperature=0)
    assert r.choices[0].text == recorded("completions", "arith/greedy")["choices"][0]["text"]
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (12, 24)


def test_a_list_of_prompts_is_answered_prompt_by_prompt_n_each(client: OpenAI) -> None:
    r = client.completions.create(
        model="tiny",
        prompt=[A, B],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompts = [c.model_extra["prompt_token_ids"] for c in r.choices]  # type: ignore[index]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert prompts[0] == recorded("completions", "arith/greedy")["choices"][0]["prompt_token_ids"]
    greedy = client.completions.create(model="tiny", prompt=[A, B], max_tokens=30, temperature=0)
    assert [c.text for c in greedy.choices] == [greedy_text(client, A, 30), greedy_text(client, B, 30)]


def test_echo_puts_the_prompt_and_its_logprobs_in_front(client: OpenAI) -> None:
    r = client.completions.create(model="tiny", prompt=A, max_tokens=4, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == A + greedy_text(client, A, 4)
    assert c.logprobs is not None and c.logprobs.token_logprobs is not None and c.logprobs.tokens is not None
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == 12 + 4


def test_logprobs_zero_gives_the_sampled_token_as_a_dict_per_token(client: OpenAI) -> None:
    c = client.completions.create(model="tiny", prompt=A, max_tokens=5, temperature=0, logprobs=0).choices[0]
    assert c.logprobs is not None and c.logprobs.top_logprobs is not None
    assert [list(d) for d in c.logprobs.top_logprobs] == [[t] for t in c.logprobs.tokens or []]


def test_a_streamed_completion_adds_up_to_the_whole_answer(client: OpenAI) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt=[A, B],
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {0: "", 1: ""}
    chunks, usage = 0, None
    for chunk in stream:
        chunks += 1
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == {0: greedy_text(client, A, 30), 1: greedy_text(client, B, 30)}
    assert chunks > 4  # token by token, not one answer at the end
    assert usage is not None and usage.prompt_tokens == 12 + 10


def test_a_chat_completion_uses_the_models_chat_template(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
    )
    want = recorded("chat", "greedy")
    assert r.choices[0].message.content == want["choices"][0]["message"]["content"]
    assert r.choices[0].message.role == "assistant"
    assert r.model_extra is not None and r.model_extra["prompt_token_ids"] == want["prompt_token_ids"]


def test_a_streamed_chat_opens_with_the_role_and_adds_up_to_the_answer(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, temperature=0, stream=True, logprobs=True, top_logprobs=2
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == recorded("chat", "greedy")["choices"][0]["message"]["content"]
    lps = [
        e
        for ch in chunks
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content or []
    ]
    assert len(lps) == 24 and all(len(e.top_logprobs) == 2 for e in lps)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_vllms_sampling_fields_go_through_extra_body(client: OpenAI) -> None:
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=24,
        temperature=0,
        extra_body={"repetition_penalty": 3.0, "return_token_ids": True},
    )
    want = recorded("completions", "x/repetition_penalty=3.0")["choices"][0]
    assert r.choices[0].model_extra["token_ids"] == want["token_ids"]  # type: ignore[index]
    assert r.choices[0].text == want["text"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "structured_outputs"),
        ({"bad_words": ["7"]}, "bad_words"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_a_vllm_field_loom_engine_does_not_implement_is_a_400_naming_it(
    client: OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=A, max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and isinstance(e.value.body, dict)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_a_model_not_served_is_the_clients_not_found_error(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)


def test_the_rollout_services_engine_route_serves_the_same_client(rollout_engine: str) -> None:
    with OpenAI(base_url=f"{rollout_engine}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        assert [m.id for m in c.models.list()] == ["tiny"]
        r = c.completions.create(model="tiny", prompt=[A, B], max_tokens=24, temperature=0)
        assert r.choices[0].text == recorded("completions", "arith/greedy")["choices"][0]["text"]
        chat = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
        assert (
            chat.choices[0].message.content == recorded("chat", "greedy")["choices"][0]["message"]["content"]
        )
        streamed = "".join(
            ch.choices[0].text
            for ch in c.completions.create(model="tiny", prompt=A, max_tokens=24, temperature=0, stream=True)
            if ch.choices
        )
        assert streamed == r.choices[0].text
