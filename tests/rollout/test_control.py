"""``loom engine``'s control plane answers as vLLM 0.32 does: the table of tests/rollout/control_cases.py
(which tests/vllm_server/test_protocol.py checks against a real vLLM server), the dev-mode and LoRA gating by
vLLM's own environment variables, and what pausing means for requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.rollout.conftest import start_engine_server, stop_process
from tests.rollout.control_cases import CASES, DEV_ROUTES, LORA_ROUTES, problems, send


@pytest.fixture(scope="module")
def served(engine_server: str) -> str:
    return str(httpx.get(f"{engine_server}/v1/models", timeout=10).json()["data"][0]["id"])


def test_loom_engine_answers_every_control_request_as_vllm_does(engine_server: str, served: str) -> None:
    found = {}
    with httpx.Client(base_url=engine_server, timeout=60) as client:
        label = client.get("/weight_info").json()["weight_version"]  # other tests' updates
        client.post("/update_weight_version", json={"new_version": "default"})
        try:
            for case in CASES:
                if diff := problems(send(client, case, served), case, served):
                    found[case.id] = diff
        finally:
            client.post("/update_weight_version", json={"new_version": label})
    assert not found, found


def test_the_base_models_card_names_its_checkpoint_and_context(engine_server: str, model_dir: Path) -> None:
    (card,) = httpx.get(f"{engine_server}/v1/models", timeout=10).json()["data"]
    assert card["root"] == str(model_dir) and card["parent"] is None
    assert card["max_model_len"] == 1024  # the random llama's max_position_embeddings


@pytest.mark.parametrize(
    ("env", "missing"),
    [
        ({}, DEV_ROUTES + LORA_ROUTES),
        ({"VLLM_SERVER_DEV_MODE": "1"}, LORA_ROUTES),
        ({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}, DEV_ROUTES),
        ({"VLLM_SERVER_DEV_MODE": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, DEV_ROUTES),
    ],
)
def test_control_routes_exist_only_under_vllms_flags(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], missing: list[tuple[str, str]]
) -> None:
    from rollout_svc.engines.server import create_engine_app
    from rollout_svc.engines.simulated import SimulatedEngine

    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = TestClient(create_engine_app(SimulatedEngine(0.0), "sim"))
    present = [r for r in DEV_ROUTES + LORA_ROUTES if r not in missing]
    for method, path in missing:
        r = client.request(method, path)
        assert (r.status_code, r.json()) == (404, {"detail": "Not Found"}), (path, r.text)
    for method, path in present:
        assert client.request(method, path).status_code != 404, path
    assert client.get("/health").status_code == 200 and client.get("/v1/models").status_code == 200


@pytest.fixture(scope="module")
def sim_server() -> Iterator[str]:
    proc, url = start_engine_server(["--simulate-ms-per-token", "20"])
    try:
        yield url
    finally:
        stop_process(proc)


def test_pause_waits_for_running_requests_and_holds_new_ones_until_resume(sim_server: str) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 200}  # 4 s at 20 ms per token

    async def scenario() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=sim_server, timeout=60) as c:
            running = asyncio.create_task(c.post("/v1/completions", json=body))
            refused: Any = None
            for _ in range(200):  # until the request runs (a loaded machine may start it late)
                await asyncio.sleep(0.02)
                refused = (await c.post("/reset_prefix_cache")).json()  # blocks held while it runs
                if refused == {"success": False} or running.done():
                    break
            pause = await c.post("/pause", params={"mode": "wait"})
            # the server answers the pause once nothing runs: a reset now finds no blocks held
            idle_at_pause = (await c.post("/reset_prefix_cache")).json()
            held = asyncio.create_task(c.post("/v1/completions", json={**body, "max_tokens": 2}))
            await asyncio.sleep(0.5)
            held_while_paused = not held.done()
            reset = (await c.post("/reset_prefix_cache")).json()
            await c.post("/resume")
            late = await held
            first = await running
            return {
                "refused": refused,
                "pause": pause.json(),
                "idle_at_pause": idle_at_pause,
                "held": held_while_paused,
                "reset": reset,
                "late": late.status_code,
                "running": first.status_code,
                "running_tokens": first.json()["usage"]["completion_tokens"],
            }

    out = asyncio.run(scenario())
    assert out["refused"] == {"success": False}
    assert out["pause"] == {"status": "paused"} and out["idle_at_pause"] == {"success": True}
    assert out["running_tokens"] == 200  # mode=wait let the running request finish, not cut it
    assert out["held"] and out["reset"] == {"success": True}
    assert out["late"] == 200 and out["running"] == 200


def test_a_reload_is_refused_before_it_touches_the_model_when_shapes_differ(
    engine_server: str, tmp_path: Path
) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.rollout.conftest import build_model_dir

    other = build_model_dir(tmp_path / "other")
    wide = LlamaConfig.from_json_file(str(other / "config.json"))
    wide.hidden_size = 48
    torch.manual_seed(0)
    LlamaForCausalLM(wide).save_pretrained(str(other))  # another model: its tensors do not fit

    def sample() -> list[int]:
        body = {"prompt": [5, 6, 7], "max_tokens": 6, "seed": 1, "return_token_ids": True}
        r = httpx.post(f"{engine_server}/v1/completions", json=body, timeout=60)
        return list(r.json()["choices"][0]["token_ids"])

    before = sample()
    r = httpx.post(
        f"{engine_server}/collective_rpc",
        json={"method": "loom_reload_weights", "kwargs": {"weights_path": str(other)}},
        timeout=60,
    )
    (result,) = r.json()["results"]
    assert result["loaded"] is False and "shape" in result["error"]
    assert sample() == before


def test_a_valid_lora_adapter_is_refused_and_the_base_stays_untouched(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``loom engine`` serves no runtime adapter beside its base (control.py ``lora_refusal``): a valid
    peft adapter, whose weights would change the answers (checked against peft), is refused with the
    documented 400 and the base model answers as before; nothing is listed or left to unload."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rollout_svc.engines.control import LORA_REFUSED
    from rollout_svc.engines.server import create_engine_app
    from rollout_svc.engines.torch import TorchEngine, teacher_forced_logprobs
    from zoo.tiny import CHECKPOINT_DIR, load_model, load_tokenizer

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    engine = TorchEngine(CHECKPOINT_DIR, cache_entries=4)
    client = TestClient(create_engine_app(engine, "tiny", load_tokenizer(), str(CHECKPOINT_DIR)))
    ids = load_tokenizer().encode("[plain] 3+4", add_special_tokens=False)
    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0.0, "logprobs": 0}

    def answer() -> tuple[list[int], list[float]]:
        r = client.post("/v1/completions", json={**body, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    before = answer()
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "adapter")})
    assert r.status_code == 400 and r.json()["error"]["type"] == LORA_REFUSED, r.text
    assert "base model only" in r.json()["error"]["message"]
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["tiny"]
    after = answer()
    assert after[0] == before[0] and after[1] == pytest.approx(before[1], abs=1e-4)
    base = teacher_forced_logprobs(load_model().eval(), ids + before[0], len(ids))
    adapted = teacher_forced_logprobs(peft_model.eval(), ids + before[0], len(ids))
    assert before[1] == pytest.approx(base, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(adapted, base, strict=True)) > 1e-2  # merging would show
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 404
    engine.stop_scheduler()
