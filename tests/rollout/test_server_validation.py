"""``loom engine``'s /v1/completions answers a malformed request with a vLLM-style 400, never a 500
(the control routes answer exactly as vLLM does: tests/rollout/test_control.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

BAD_COMPLETIONS: list[Any] = [
    [1, 2],
    "hi",
    None,
    {"prompt": [True, False]},
    {"prompt": [[1, True]]},
    {"prompt": [1, 2], "skip_special_tokens": "no"},
    {"prompt": [1, 2], "echo": 1},
    {"prompt": [1, 2], "return_token_ids": "yes"},
    {"prompt": [1, 2], "n": 0},
    {"prompt": [1, 2], "n": 2.7},
    {"prompt": [1, 2], "n": True},
    {"prompt": [1, 2], "max_tokens": 0},
    {"prompt": [1, 2], "max_tokens": 4.0},
    {"prompt": [1, 2], "stop": {"a": 1}},
    {"prompt": [1, 2], "stop": ["a", 3]},
    {"prompt": [1, 2], "logprobs": True},
]


def _post(url: str, body: Any) -> httpx.Response:
    if isinstance(body, str) and body.startswith("{not"):
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url, json=body, timeout=60)


def _assert_400(r: httpx.Response) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "BadRequestError" and err["message"]


@pytest.mark.parametrize("body", BAD_COMPLETIONS, ids=repr)
def test_completions_rejects_malformed_body(engine_server: str, body: Any) -> None:
    _assert_400(_post(f"{engine_server}/v1/completions", body))


def test_text_offset_is_each_tokens_first_character_in_the_text(engine_server: str) -> None:
    # it held token indices (0, 1, 2, ...); vLLM's are character offsets into the choice's text
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "seed": 3, "logprobs": 0, "skip_special_tokens": False}
    r = httpx.post(f"{engine_server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert offsets[0] == 0 and len(offsets) == len(tokens) and offsets == sorted(offsets)
    text = choice["text"]
    # the test tokenizer's token strings are their text: each one sits at its offset
    assert all(text[o : o + len(t)] == t for o, t in zip(offsets, tokens, strict=True)), (
        text,
        offsets,
        tokens,
    )
    assert offsets[-1] + len(tokens[-1]) == len(text)


def test_text_offset_counts_characters_not_tokens(tokenizer: Any) -> None:
    from rollout_svc.engines.openai_protocol import Text, completion_logprobs

    ids = tokenizer.convert_tokens_to_ids(["<ignore>", "a", "b"])
    t = Text(tokenizer, skip_special=False)
    logprobs = completion_logprobs(ids, [-1.0, -1.0, -1.0], [None, None, None], t)
    assert t.decode(ids) == "<ignore>ab"
    assert logprobs["text_offset"] == [0, 8, 9]  # token indices would read [0, 1, 2]


def test_an_unknown_model_is_a_404_as_on_vllm(engine_server: str) -> None:
    # it was echoed back in the answer's "model" as though it were served
    served = httpx.get(f"{engine_server}/v1/models", timeout=10).json()["data"][0]["id"]
    base = {"prompt": [1, 2, 3], "max_tokens": 2}
    r = httpx.post(f"{engine_server}/v1/completions", json={**base, "model": "no-such-model"}, timeout=60)
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model"
    # vLLM 0.32 names the served models
    assert err["message"] == f"The model `no-such-model` does not exist. Valid aliases: {served}."
    _assert_400(httpx.post(f"{engine_server}/v1/completions", json={**base, "model": ["x"]}, timeout=60))
    for body in ({**base, "model": served}, base):  # the served name, or none: the served model
        ok = httpx.post(f"{engine_server}/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200 and ok.json()["model"] == served, ok.text
