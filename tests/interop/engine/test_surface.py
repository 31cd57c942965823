"""loom engine's OpenAI surface beyond the recorded answers: every vLLM 0.32 request field is either
honoured or refused with a 400 naming it; TRL's routes; streaming details; the model's defaults."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from rollout_svc.engines.openai_api import engine_router
from rollout_svc.engines.openai_protocol import (
    CHAT_ONLY,
    COMPLETION_ONLY,
    NO_EFFECT,
    REFUSED,
    SAMPLING,
    generation_defaults,
)
from rollout_svc.engines.torch import TorchEngine, resolve_model_path

A = "[plain] Compute 47+85.\n"
CHAT = [{"role": "user", "content": "[plain] Compute 47+85."}]
RECORDED = json.loads(Path(__file__).with_name("vllm_0.32_tiny.json").read_text())

# The fields of vLLM 0.32's request models (CompletionRequest; what ChatCompletionRequest and
# BatchChatCompletionRequest add), read from vllm/entrypoints/openai/*/protocol.py.
VLLM_COMPLETION_FIELDS = """add_special_tokens allowed_token_ids bad_words cache_salt ec_transfer_params echo
frequency_penalty ignore_eos include_stop_str_in_output kv_transfer_params length_penalty logit_bias
logprob_token_ids logprobs max_tokens min_p min_tokens mm_payload model n presence_penalty priority prompt
prompt_embeds prompt_logprobs repetition_detection repetition_penalty request_id response_format
return_mm_kwargs return_token_ids return_token_offsets return_tokens_as_token_ids routed_experts_prompt_start
seed session_id skip_special_tokens spaces_between_special_tokens stop stop_token_ids stream stream_interval
stream_options structured_outputs suffix temperature thinking_token_budget top_k top_p truncate_prompt_tokens
truncation_side use_beam_search user vllm_xargs watermarking""".split()
VLLM_CHAT_FIELDS = """add_generation_prompt chat_template chat_template_kwargs continue_final_message
documents
include_reasoning max_completion_tokens media_io_kwargs messages mm_processor_kwargs parallel_tool_calls
reasoning_effort return_prompt_text tool_choice tools top_logprobs best_of early_stopping
guided_decoding_backend""".split()

NOT_DEFAULT: dict[str, Any] = {  # a value other than the accepted default, per refused field
    "use_beam_search": True,
    "length_penalty": 2.0,
    "early_stopping": True,
    "best_of": 2,
    "watermarking": True,
    "bad_words": ["7"],
    "logprob_token_ids": [1, 2],
    "structured_outputs": {"regex": "[0-9]+"},
    "guided_decoding_backend": "xgrammar",
    "response_format": {"type": "json_object"},
    "suffix": "x",
    "prompt_embeds": "AAAA",
    "priority": 1,
    "cache_salt": "salt",
    "kv_transfer_params": {"do_remote_prefill": True},
    "ec_transfer_params": {"x": 1},
    "vllm_xargs": {"x": 1},
    "repetition_detection": {"max_pattern_size": 4},
    "thinking_token_budget": 8,
    "routed_experts_prompt_start": 1,
    "media_io_kwargs": {"image": {}},
    "mm_processor_kwargs": {"x": 1},
}


def test_every_vllm_request_field_is_honoured_accepted_or_refused() -> None:
    known = SAMPLING | COMPLETION_ONLY | CHAT_ONLY | NO_EFFECT | set(REFUSED)
    assert set(VLLM_COMPLETION_FIELDS) | set(VLLM_CHAT_FIELDS) <= known
    assert not (SAMPLING | COMPLETION_ONLY | CHAT_ONLY) & set(REFUSED)
    assert set(NOT_DEFAULT) == set(REFUSED)


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_field_loom_engine_does_not_implement_is_a_400_naming_it(
    loom_engine: str, route: str, field: str
) -> None:
    base: dict[str, Any] = {"prompt": A} if route == "/v1/completions" else {"messages": CHAT}
    r = httpx.post(
        f"{loom_engine}{route}", json={**base, "max_tokens": 2, field: NOT_DEFAULT[field]}, timeout=60
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "BadRequestError"
    ok = httpx.post(f"{loom_engine}{route}", json={**base, "max_tokens": 2, field: None}, timeout=60)
    assert ok.status_code == 200, ok.text  # null is the default: accepted


def test_a_field_vllm_does_not_know_is_ignored_as_vllm_ignores_it(loom_engine: str) -> None:
    r = httpx.post(f"{loom_engine}/v1/completions", json={"prompt": A, "max_tokens": 2, "no_such_field": 1})
    assert r.status_code == 200, r.text


def test_trls_server_routes(loom_engine: str) -> None:
    info = httpx.get(f"{loom_engine}/server_info", params={"config_format": "json"}).json()
    assert info["vllm_config"]["weight_transfer_config"] is None
    assert info["vllm_config"]["model_config"]["max_model_len"] == 512
    text = httpx.get(f"{loom_engine}/server_info").json()["vllm_config"]
    assert isinstance(text, str) and "max_model_len" in text
    assert httpx.get(f"{loom_engine}/get_world_size").json() == {"world_size": 1}


@pytest.mark.parametrize(
    "route",
    ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"],
)
def test_the_nccl_weight_transfer_routes_are_refused_naming_themselves(loom_engine: str, route: str) -> None:
    r = httpx.post(f"{loom_engine}{route}", json={})
    assert r.status_code == 501
    err = r.json()["error"]
    assert err["message"].startswith(f"{route}: loom engine has no NCCL weight-transfer engine")
    assert "/collective_rpc" in err["message"]


def sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_stream_interval_batches_tokens_but_sends_the_first_at_once(loom_engine: str) -> None:
    body = {"prompt": A, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = sse(f"{loom_engine}/v1/completions", {**body, "return_token_ids": True, "stream_interval": 4})
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]
    assert sizes[0] == 1 and sum(sizes) == 20 and all(s == 4 for s in sizes[1:-1]) and sizes[-1] <= 4
    text = "".join(c["choices"][0]["text"] for c in chunks)
    whole = httpx.post(f"{loom_engine}/v1/completions", json={**body, "stream": False}, timeout=60).json()
    assert text == whole["choices"][0]["text"]


def test_a_stream_held_back_at_a_stop_string_never_shows_it(loom_engine: str) -> None:
    body = {"prompt": A, "max_tokens": 40, "temperature": 0, "stream": True, "stop": ["</think>"]}
    chunks = sse(f"{loom_engine}/v1/completions", body)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert "</think>" not in text and "</" not in text and text.endswith("r132 ")
    assert chunks[-1]["choices"][0]["stop_reason"] == "</think>"


def test_a_stream_that_cannot_start_is_a_json_400_not_a_broken_stream(loom_engine: str) -> None:
    r = httpx.post(f"{loom_engine}/v1/completions", json={"prompt": [600], "max_tokens": 2, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["message"] == "Token id 600 is out of vocabulary"


def test_the_batch_chat_route_refuses_what_vllm_does_not_batch(loom_engine: str) -> None:
    url = f"{loom_engine}/v1/chat/completions/batch"
    for extra, param in (({"stream": True}, "stream"), ({"n": 2, "temperature": 1.0}, "n")):
        r = httpx.post(url, json={"messages": [CHAT], "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(url, json={"messages": CHAT, "max_tokens": 2})  # one conversation, not a list of them
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny"
    shutil.copytree(resolve_model_path("tiny"), path)
    return path


@pytest.fixture(scope="module")
def no_template_app(tiny_copy: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The tiny model without its chat template, and with a generation_config.json that sets a
    repetition penalty (as Qwen's does): served in-process by the same routes."""
    path = tmp_path_factory.mktemp("plain") / "tiny"
    shutil.copytree(tiny_copy, path)
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 3.0}))
    engine = TorchEngine(path, cache_entries=2)
    app = FastAPI()
    app.include_router(engine_router(engine, "tiny", engine.tokenizer, {"tiny"}))
    with TestClient(app) as client:
        yield client
    engine.stop_scheduler()


def test_a_model_without_a_chat_template_answers_chat_with_a_400(no_template_app: TestClient) -> None:
    r = no_template_app.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2})
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_the_models_generation_config_sets_the_defaults_as_on_vllm(
    no_template_app: TestClient, tiny_copy: Path
) -> None:
    assert generation_defaults(tiny_copy) == {}  # the shipped tiny model sets none
    want = RECORDED["completions"]["x/repetition_penalty=3.0"]["response"]["choices"][0]["token_ids"]
    body = {"prompt": "x", "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    r = no_template_app.post("/v1/completions", json=body)
    assert r.json()["choices"][0]["token_ids"] == want  # vLLM's answer with repetition_penalty=3.0
    plain = no_template_app.post("/v1/completions", json={**body, "repetition_penalty": 1.0})
    assert (
        plain.json()["choices"][0]["token_ids"]
        == RECORDED["completions"]["x/greedy"]["response"]["choices"][0]["token_ids"]
    )
