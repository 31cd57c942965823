"""loom.fci: the streaming FCI scorer equals eager attention's, the zeroing rules, and the engine
capability (torch engine and `loom engine` route; vLLM refuses with a typed error)."""

from __future__ import annotations

from asyncio import run

import pytest
import torch
from fastapi.testclient import TestClient

from loom.fci import fci_scores, fci_scores_eager, zero_rules
from rollout_svc.engines.base import InvalidPrompt, UnsupportedCapability
from rollout_svc.engines.server import create_engine_app
from rollout_svc.engines.vllm import VLLMEngine

STEPS = [(0, 11), (11, 20), (20, 23), (23, 40), (40, 52), (52, 60), (60, 75), (75, 90)]


def _ids(n: int = 90, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("block", [1, 7, 256])
def test_streaming_fci_equals_eager_attention(random_llama, block):
    ids = _ids()
    got = fci_scores(random_llama, ids, STEPS, delta=2, zero_from=7, block=block)
    want = fci_scores_eager(random_llama, ids, STEPS, delta=2, zero_from=7)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-5
    assert sum(v > 0 for v in got) >= 3  # real scores, not all zeroed
    assert random_llama.config._attn_implementation == "sdpa"  # restored after the pass


def test_fci_brute_force_from_attention_maps(random_llama):
    """Eq. 5-6 written out over the eager maps: max over layers/heads of summed step-pair means."""
    ids = _ids(seed=1)
    with torch.no_grad():
        random_llama.set_attn_implementation("eager")
        att = random_llama(torch.tensor([ids]), output_attentions=True).attentions
        random_llama.set_attn_implementation("sdpa")
    delta = 3
    want = []
    for k in range(len(STEPS)):
        best = 0.0
        for layer in att:
            for h in range(layer.shape[1]):
                total = sum(
                    float(layer[0, h, STEPS[j][0] : STEPS[j][1], STEPS[k][0] : STEPS[k][1]].mean())
                    for j in range(k + delta, len(STEPS))
                )
                best = max(best, total)
        want.append(best)
    got = fci_scores(random_llama, ids, STEPS, delta=delta, block=16)
    assert torch.allclose(torch.tensor(got), torch.tensor(zero_rules(want, None)), atol=1e-5)


def test_zero_rules_prompt_first_step_and_after_end():
    assert zero_rules([5.0, 4.0, 3.0, 2.0, 1.0], zero_from=3) == [0.0, 0.0, 3.0, 0.0, 0.0]
    assert zero_rules([5.0, 4.0, 3.0], zero_from=None) == [0.0, 0.0, 3.0]


def test_torch_engine_and_loom_engine_route_score_attention(tiny_engine):
    ids = _ids(60, seed=2)
    ids = [i + 3 for i in ids]
    steps = [(0, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60)]
    direct = run(tiny_engine.score_attention(ids, steps, 2, None))
    assert "attention_scores" in tiny_engine.capabilities
    client = TestClient(create_engine_app(tiny_engine, "tiny", tiny_engine.tokenizer))
    r = client.post("/v1/score/attention", json={"token_ids": ids, "steps": steps, "delta": 2})
    assert r.status_code == 200
    assert r.json()["scores"] == pytest.approx(direct, abs=1e-6)
    bad = client.post("/v1/score/attention", json={"token_ids": ids, "steps": [[5, 5]]})
    assert bad.status_code == 400
    other = {"token_ids": ids, "steps": steps, "policy_version": 5, "policy_namespace": "run-a"}
    r = client.post("/v1/score/attention", json=other)  # a version it does not serve: no scores
    assert r.status_code == 409 and r.json()["error"]["type"] == "attention_version_unavailable"
    # what the model cannot read is refused before it sees it (was a 500 here; on CUDA a device-side
    # assert that left the engine's CUDA context unusable for every later request)
    vocab, context = tiny_engine.vocab_size, tiny_engine.max_model_len
    long_ids = [5] * (context + 1)
    for body, field in (
        ({"token_ids": ids[:30] + [vocab] + ids[31:], "steps": steps}, "token_ids[30]"),
        ({"token_ids": long_ids, "steps": [(0, 10), (10, context + 1)]}, "context holds"),
        ({"token_ids": ids, "steps": [(i, i + 1) for i in range(60)] * 69}, "at most 4096"),
    ):
        r = client.post("/v1/score/attention", json=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
    with pytest.raises(InvalidPrompt, match="vocabulary"):
        run(tiny_engine.score_attention([vocab + 7, 1, 2], [(0, 1), (1, 3)], 2, None))
    again = client.post("/v1/score/attention", json={"token_ids": ids, "steps": steps, "delta": 2})
    assert again.status_code == 200 and again.json()["scores"] == pytest.approx(direct, abs=1e-6)


def test_vllm_engine_has_no_attention_capability():
    engine = VLLMEngine("http://127.0.0.1:9")  # never contacted: the refusal is local
    with pytest.raises(UnsupportedCapability, match="attention_scores"):
        run(engine.score_attention([1, 2, 3], [(0, 1), (1, 3)]))
