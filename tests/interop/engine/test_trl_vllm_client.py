"""TRL 1.16's own ``VLLMClient`` (trl/generation/vllm_client.py, installed from PyPI) against
``loom engine`` and against the rollout service's ``/engine`` routes, both real server processes.

``VLLMClient.__init__`` refuses to build unless the ``vllm`` package is importable (a trainer that
uses it has vLLM installed); Loom's test environment has no vLLM, so that one install check is
patched. Every request and every reading of a reply below is TRL's code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from trl.generation import vllm_client as trl_vllm

A = "[plain] Compute 47+85.\n"
B = "[plain] Compute 1+1.\n"
RECORDED = json.loads(Path(__file__).with_name("vllm_0.32_tiny.json").read_text())
VLLM_GREEDY_A = RECORDED["completions"]["arith/greedy"]["response"]["choices"][0]
VLLM_CHAT = RECORDED["chat"]["greedy"]["response"]


@pytest.fixture(params=["loom_engine", "rollout_engine"])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(request.param))


@pytest.fixture
def client(url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], Any]]:
    monkeypatch.setattr(trl_vllm, "is_vllm_available", lambda *a, **k: True)  # the install check only
    made: list[Any] = []

    def make() -> Any:
        c = trl_vllm.VLLMClient(base_url=url, connection_timeout=60)
        made.append(c)
        return c

    yield make
    for c in made:
        c.session.close()


def test_the_client_connects_and_reads_the_served_model(client: Callable[[], Any]) -> None:
    c = client()
    assert c.model == "tiny"  # from /v1/models
    assert c.get_world_size() == 1
    info = c.get_server_info()
    assert info["weight_transfer_config"] is None and info["model_config"]["max_logprobs"] == 20


def test_generate_a_batch_of_text_prompts_with_per_token_logprob_dicts(client: Callable[[], Any]) -> None:
    out = client().generate(
        [A, B], n=3, max_tokens=6, temperature=1.0, logprobs=0, generation_kwargs={"seed": 1}
    )
    assert len(out["prompt_ids"]) == 2 and len(out["completion_ids"]) == 6
    assert out["prompt_ids"][0] == VLLM_GREEDY_A["prompt_token_ids"]  # prompt-major: A's first
    for ids, lps, lp_ids in zip(
        out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True
    ):
        assert 1 <= len(ids) <= 6 and len(lps) == len(ids) == len(lp_ids)
        # logprobs=0: the sampled token alone at every position (a dict per token on the wire)
        assert [p[0] for p in lp_ids] == ids and all(len(p) == 1 and p[0] <= 0 for p in lps)


def test_greedy_generate_gives_what_vllm_gave(client: Callable[[], Any]) -> None:
    out = client().generate([A], max_tokens=24, temperature=0.0, logprobs=0)
    assert out["completion_ids"] == [VLLM_GREEDY_A["token_ids"]]


def test_generate_from_token_ids_with_top_logprobs(client: Callable[[], Any]) -> None:
    ids = VLLM_GREEDY_A["prompt_token_ids"]
    out = client().generate([ids, ids[:5]], max_tokens=5, temperature=0.0, logprobs=2)
    assert out["prompt_ids"] == [ids, ids[:5]]
    for tokens, lps, lp_ids in zip(
        out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True
    ):
        for t, pos_lps, pos_ids in zip(tokens, lps, lp_ids, strict=True):
            # the sampled token and the top 2, sorted by descending log-prob (2 or 3 entries)
            assert t in pos_ids and len(pos_ids) in (2, 3) and pos_lps == sorted(pos_lps, reverse=True)
    assert client().generate([ids], max_tokens=2, logprobs=None)["logprobs"] is None


def test_chat_renders_the_chat_template_as_vllm_did(client: Callable[[], Any]) -> None:
    out = client().chat(
        [[{"role": "user", "content": "[plain] Compute 47+85."}]] * 2, max_tokens=24, temperature=0
    )
    assert out["prompt_ids"] == [VLLM_CHAT["prompt_token_ids"]] * 2
    assert out["completion_ids"] == [VLLM_CHAT["choices"][0]["token_ids"]] * 2
    assert [[p[0] for p in seq] for seq in out["logprob_token_ids"]] == out["completion_ids"]


def test_sequence_logprobs_are_the_sampled_logprobs_of_the_same_tokens(client: Callable[[], Any]) -> None:
    c = client()
    gen = c.generate([A], max_tokens=8, temperature=1.0, logprobs=0, generation_kwargs={"seed": 7})
    prompt, completion = gen["prompt_ids"][0], gen["completion_ids"][0]
    scored = c.get_sequence_logprobs([prompt + completion], [len(prompt)], top_logprobs=5)
    actual = [pos[0] for pos in scored["actual_logprobs"][0]]
    sampled = [pos[0] for pos in gen["logprobs"][0]]
    assert len(actual) == len(completion)
    assert all(math.isclose(a, s, abs_tol=1e-4) for a, s in zip(actual, sampled, strict=True))
    assert all(len(row) == 5 and row == sorted(row, reverse=True) for row in scored["logprobs"][0])


def test_sequence_logprobs_at_trls_default_100_are_refused_as_vllm_refuses_them(
    client: Callable[[], Any],
) -> None:
    with pytest.raises(Exception, match="400.*greater than max allowed: 20"):  # vLLM without --max-logprobs
        client().get_sequence_logprobs([[61, 383, 63, 347]], [2])


def test_weight_sync_stops_with_a_clear_error_on_both_routes(client: Callable[[], Any]) -> None:
    c = client()
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):  # TRL reads /server_info
        c.init_communicator(device="cpu")
    with pytest.raises(Exception, match="501.*/start_weight_update: loom engine has no NCCL weight-transfer"):
        c.update_named_param("model.norm.weight", __import__("torch").zeros(128))


def test_reset_prefix_cache(client: Callable[[], Any]) -> None:
    client().reset_prefix_cache()  # raises unless 200
