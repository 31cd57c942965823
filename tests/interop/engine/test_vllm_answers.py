"""loom engine answers as a real vLLM 0.32 does: every request recorded from vLLM on the tiny model
(vllm_0.32_tiny.json, recorded by record_vllm.py) is replayed against ``loom engine --model tiny``.

Greedy token ids, texts, finish and stop reasons, prompt token ids (the chat template), token strings
and text offsets must be equal; log-probs agree to 1e-4 (vLLM's CPU kernels against transformers);
an error is the same status (and the same ``param`` where vLLM names a field); a stream has the same
chunks per choice, the same text, token ids and usage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

RECORDED = json.loads((Path(__file__).with_name("vllm_0.32_tiny.json")).read_text())
ATOL = 1e-4
ROUTES = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "batch": "/v1/chat/completions/batch",
}
CASES = [(section, name) for section in ROUTES for name in RECORDED[section]]


def close_logprob(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and abs(a - b) <= ATOL)


def same_top(a: dict[str, float] | None, b: dict[str, float] | None) -> None:
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert list(a) == list(b)  # the same tokens, in vLLM's order (the sampled one first)
        assert all(close_logprob(a[k], b[k]) for k in a), (a, b)


def same_completion_logprobs(ours: dict[str, Any] | None, vllm: dict[str, Any] | None) -> None:
    assert (ours is None) == (vllm is None)
    if ours is None or vllm is None:
        return
    assert ours["tokens"] == vllm["tokens"] and ours["text_offset"] == vllm["text_offset"]
    assert all(
        close_logprob(a, b) for a, b in zip(ours["token_logprobs"], vllm["token_logprobs"], strict=True)
    )
    for a, b in zip(ours["top_logprobs"], vllm["top_logprobs"], strict=True):
        same_top(a, b)


def same_chat_logprobs(ours: dict[str, Any] | None, vllm: dict[str, Any] | None) -> None:
    assert (ours is None) == (vllm is None)
    if ours is None or vllm is None:
        return
    for a, b in zip(ours["content"], vllm["content"], strict=True):
        assert (
            a["token"] == b["token"]
            and a["bytes"] == b["bytes"]
            and close_logprob(a["logprob"], b["logprob"])
        )
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
        assert all(
            close_logprob(x["logprob"], y["logprob"])
            for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True)
        )


def same_prompt_logprobs(ours: list[Any] | None, vllm: list[Any] | None) -> None:
    assert (ours is None) == (vllm is None)
    for a, b in zip(ours or [], vllm or [], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert list(a) == list(b)
            for k in a:
                assert a[k]["rank"] == b[k]["rank"] and a[k]["decoded_token"] == b[k]["decoded_token"]
                assert close_logprob(a[k]["logprob"], b[k]["logprob"])


@pytest.mark.parametrize(("section", "name"), CASES, ids=[f"{s}:{n}" for s, n in CASES])
def test_loom_engine_answers_the_recorded_vllm_request_as_vllm_did(
    loom_engine: str, section: str, name: str
) -> None:
    case = RECORDED[section][name]
    r = httpx.post(f"{loom_engine}{ROUTES[section]}", json=case["request"], timeout=120)
    ours, vllm = r.json(), case["response"]
    assert r.status_code == case["status"], (r.text, vllm)
    if r.status_code != 200:
        param = vllm["error"]["param"]
        if param is not None and not param.startswith("body."):  # pydantic's paths are vLLM's own
            assert ours["error"]["param"] == param, (ours, vllm)
        assert ours["error"]["code"] == r.status_code and ours["error"]["message"]
        return
    assert ours["object"] == vllm["object"] and ours["model"] == vllm["model"]
    assert set(ours) >= set(vllm) - {"kv_transfer_params", "ec_transfer_params", "metrics"}
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert ours["usage"][key] == vllm["usage"][key]
    assert ours.get("prompt_token_ids") == vllm.get("prompt_token_ids")  # chat: the template's tokens
    assert ours.get("prompt_text") == vllm.get("prompt_text")
    assert len(ours["choices"]) == len(vllm["choices"])
    for a, b in zip(ours["choices"], vllm["choices"], strict=True):
        assert set(a) == set(b)
        for key in ("index", "token_ids", "prompt_token_ids", "finish_reason", "stop_reason", "text"):
            assert a.get(key) == b.get(key), (key, a.get(key), b.get(key))
        if "message" in a:
            assert a["message"] == b["message"]
            same_chat_logprobs(a["logprobs"], b["logprobs"])
        else:
            same_completion_logprobs(a["logprobs"], b["logprobs"])
            same_prompt_logprobs(a["prompt_logprobs"], b["prompt_logprobs"])


def read_stream(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln[len("data: ") :] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"], lines[-1] == "[DONE]"


def per_choice(chunks: list[dict[str, Any]], text_key: str) -> dict[int, dict[str, Any]]:
    """Per choice index: its chunks' texts, token ids, log-prob tokens, and how it ended."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            s = out.setdefault(c["index"], {"texts": [], "token_ids": [], "tokens": [], "finish": None})
            delta = c["delta"].get("content", "") if text_key == "delta" else c["text"]
            s["texts"].append(delta)
            s["token_ids"] += c.get("token_ids") or []
            if c.get("logprobs"):
                lp = c["logprobs"]
                s["tokens"] += [e["token"] for e in lp["content"]] if "content" in lp else lp["tokens"]
            s["finish"] = s["finish"] or c.get("finish_reason")
            if c.get("prompt_token_ids") is not None:
                s["prompt_token_ids"] = c["prompt_token_ids"]
    return out


@pytest.mark.parametrize("name", list(RECORDED["streams"]))
def test_loom_engine_streams_the_recorded_vllm_request_as_vllm_did(loom_engine: str, name: str) -> None:
    case = RECORDED["streams"][name]
    chunks, done = read_stream(f"{loom_engine}{case['route']}", case["request"])
    assert done and case["done"]
    key = "delta" if case["route"].endswith("chat/completions") else "text"
    ours, vllm = per_choice(chunks, key), per_choice(case["chunks"], key)
    assert ours == vllm  # every chunk's text, the token ids, the log-prob tokens, the finish reasons
    usage_ours = [c["usage"] for c in chunks if c.get("usage")]
    usage_vllm = [c["usage"] for c in case["chunks"] if c.get("usage")]
    assert usage_ours == usage_vllm
    tops = [c.get("prompt_token_ids") for c in chunks]
    assert tops == [c.get("prompt_token_ids") for c in case["chunks"]]
