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


def _peft_adapter(folder: Path, seed: int, targets: list[str]) -> Any:
    """A peft LoRA adapter of the tiny model saved in ``folder``, its B factors drawn large enough
    that its answers differ from the base's; the peft model itself (the reference) is returned."""
    import torch
    from peft import LoraConfig, get_peft_model

    from zoo.tiny import load_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(load_model(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


def test_lora_adapters_are_served_by_name_beside_the_untouched_base(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two runtime adapters loaded: the base, adapter 1 and adapter 2 each answer with their own
    weights (log-probs equal to a teacher-forced pass of peft's model with that adapter, and of the
    plain model for the base); ``/v1/models`` lists them with their parent; one adapter beyond
    ``max_loras`` and one whose tensors do not fit the base are refused (the reason, no server
    path); unloading restores the base-only listing and the unloaded name is then unknown."""
    from safetensors.torch import load_file, save_file

    from rollout_svc.engines.control import LORA_LIMIT
    from rollout_svc.engines.server import create_engine_app
    from rollout_svc.engines.torch import TorchEngine, teacher_forced_logprobs
    from zoo.tiny import CHECKPOINT_DIR, load_model, load_tokenizer

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    refs = {
        "a1": _peft_adapter(tmp_path / "a1", 0, ["q_proj", "v_proj"]),
        "a2": _peft_adapter(tmp_path / "a2", 1, ["o_proj", "down_proj"]),
        "tiny": load_model().eval(),
    }
    engine = TorchEngine(CHECKPOINT_DIR, cache_entries=4)
    app = create_engine_app(engine, "tiny", load_tokenizer(), str(CHECKPOINT_DIR), max_loras=2)
    client = TestClient(app)
    ids = load_tokenizer().encode("[plain] 3+4", add_special_tokens=False)

    def answer(model: str) -> tuple[list[int], list[float]]:
        body = {"model": model, "prompt": ids, "max_tokens": 6, "temperature": 0.0, "logprobs": 0}
        r = client.post("/v1/completions", json={**body, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def load(name: str, folder: Path) -> httpx.Response:
        return client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)})

    before = answer("tiny")
    for name in ("a1", "a2"):
        r = load(name, tmp_path / name)
        assert r.status_code == 200 and r.text == f"Success: LoRA adapter '{name}' added successfully."
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("tiny", None, str(CHECKPOINT_DIR)),
        ("a1", "tiny", str(tmp_path / "a1")),
        ("a2", "tiny", str(tmp_path / "a2")),
    ]
    got = {name: answer(name) for name in refs}
    for name, (tokens, logprobs) in got.items():
        assert logprobs == pytest.approx(
            teacher_forced_logprobs(refs[name], ids + tokens, len(ids)), abs=1e-4
        )
    assert got["tiny"][0] == before[0] and got["tiny"][1] == pytest.approx(before[1], abs=1e-4)
    for name in ("a1", "a2"):  # each adapter's own weights: the base's pass on its tokens differs
        tokens, logprobs = got[name]
        plain = teacher_forced_logprobs(refs["tiny"], ids + tokens, len(ids))
        assert max(abs(a - b) for a, b in zip(logprobs, plain, strict=True)) > 1e-2, name
    assert got["a1"] != got["a2"]

    r = load("a3", tmp_path / "a1")  # a third one: over max_loras
    assert r.status_code == 400 and r.json()["error"]["type"] == LORA_LIMIT, r.text
    assert "2 LoRA adapters are loaded" in r.json()["error"]["message"]
    bad = tmp_path / "bad"
    _peft_adapter(bad, 2, ["q_proj"])
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    first = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[first] = tensors[first][:, :-1].contiguous()  # one input column fewer than the base's
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 200
    r = load("bad", bad)
    error = r.json()["error"]
    assert (
        r.status_code == 400
        and "has shape" in error["message"]
        and "the base model needs" in error["message"]
    )
    assert str(tmp_path) not in error["message"], error

    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' removed successfully."
    assert [c["id"] for c in client.get("/v1/models").json()["data"]] == ["tiny"]
    r = client.post("/v1/completions", json={"model": "a1", "prompt": ids, "max_tokens": 2})
    assert r.status_code == 404 and "`a1` does not exist" in r.json()["error"]["message"], r.text
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 404
    assert answer("tiny")[1] == pytest.approx(before[1], abs=1e-4)
    engine.stop_scheduler()
