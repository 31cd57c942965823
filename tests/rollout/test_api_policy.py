"""POST /v1/rollouts and /v1/policy (in-process FastAPI app on the torch engine), and policy versions
published through the vllm client's control plane to `loom engine`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loom.contracts.settings import Settings
from loom.contracts.wire import Group, SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines import set_engine
from rollout_svc.engines.torch import TorchEngine, load_model, teacher_forced_logprobs
from tests.rollout.conftest import build_model_dir


@pytest.fixture
def store(tmp_path: Path) -> PolicyStore:
    """A policy store whose version 1 is a different random model (seed 1)."""
    s = PolicyStore(tmp_path / "policy")
    s.publish(1, lambda d: build_model_dir(d, seed=1))
    return s


@pytest.fixture
def client(
    torch_engine: Any, store: PolicyStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TestClient, TorchEngine]]:
    monkeypatch.setenv("LOOM_DATA_DIR", str(tmp_path / "data"))
    from loom.contracts.settings import get_settings

    get_settings.cache_clear()
    from rollout_svc.api import app

    engine = TorchEngine(torch_engine.model_path, model=torch_engine.model, tokenizer=torch_engine.tokenizer)
    set_engine(engine)
    saved = app.state.settings
    app.state.settings = Settings(data_dir=tmp_path / "data", policy_store=store.root)
    try:
        with TestClient(app) as c:
            yield c, engine
    finally:
        app.state.settings = saved
        set_engine(None)
        get_settings.cache_clear()


def test_rollouts_route_returns_a_group(client: Any) -> None:
    c, engine = client
    body = {"group_id": "api-1", "prompt": "2+2?", "sampling": {"n": 2, "max_tokens": 6, "seed": 1}}
    r = c.post("/v1/rollouts", json=body)
    assert r.status_code == 200, r.text
    group = Group.model_validate(r.json())
    assert group.id == "api-1" and len(group.trajectories) == 2
    assert all(
        t.engine == "torch" and len(t.completion_ids) == len(t.logprobs or []) for t in group.trajectories
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"prompt": "x", "mode": "plain", "mode_params": {"layout": "x"}}, "no mode_params"),
        ({"prompt": "x", "mode": "streaming", "mode_params": {"layout": "interleaved"}}, "sentences"),
        ({"prompt": "x", "sampling": {"n": 0}}, "n"),
        ({"prompt": "x", "prompt_ids": [1]}, "exactly one"),
    ],
)
def test_bad_requests_are_422_naming_the_limit(client: Any, body: dict, needle: str) -> None:
    c, _ = client
    r = c.post("/v1/rollouts", json=body)
    assert r.status_code == 422
    assert needle in r.text


def test_group_positions_on_vllm_is_422_naming_the_capability(client: Any, vllm_engine: Any) -> None:
    c, _ = client
    set_engine(vllm_engine)
    body = {
        "prompt": "[stream]",
        "mode": "streaming",
        "mode_params": {"sentences": ["a b."], "layout": "group_positions"},
    }
    r = c.post("/v1/rollouts", json=body)
    assert r.status_code == 422
    assert r.json()["error"] == "unsupported_capability" and "group_positions" in r.json()["detail"]


def test_policy_route_loads_a_store_version_and_trajectories_carry_it(
    client: Any, store: PolicyStore
) -> None:
    c, engine = client
    r = c.post("/v1/policy", json={"version": 1})
    assert r.status_code == 200 and r.json()["policy_version"] == 1
    body = {"prompt": "hi", "sampling": {"max_tokens": 6}, "policy_version": 1}
    g = Group.model_validate(c.post("/v1/rollouts", json=body).json())
    (t,) = g.trajectories
    assert t.policy_version == 1
    new_model = load_model(store.path_of(1))
    ref = teacher_forced_logprobs(new_model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
    assert t.logprobs == pytest.approx(ref, abs=1e-4)
    assert c.post("/v1/policy", json={"version": 7}).status_code == 404


def test_a_request_without_a_version_gets_the_base_model_not_what_the_replica_holds(
    client: Any, store: PolicyStore, tmp_path: Path
) -> None:
    """The replica last served another key's private version; a request naming no version is served
    the deployment's base model (version 0), its trajectories labelled so (docs/security.md)."""
    c, engine = client
    from rollout_svc.api import app

    # version 0 is the deployment's model (LOOM_MODEL): here the engine's own
    app.state.settings = app.state.settings.model_copy(update={"model": str(engine.model_path)})
    alice = store.namespace("alice")
    alice.publish(1, lambda d: build_model_dir(d, seed=1))
    body = {"prompt": "hi", "sampling": {"max_tokens": 6, "seed": 3}}
    private = {**body, "policy_version": 1, "policy_namespace": "alice", "policy_match": "exact"}
    r = c.post("/v1/rollouts", json=private)
    assert r.status_code == 200, r.text
    assert engine.policy_namespace == "alice" and engine.policy_version == 1
    (t,) = Group.model_validate(c.post("/v1/rollouts", json=body).json()).trajectories
    assert (t.policy_namespace, t.policy_version) == (None, 0)
    base = load_model(Path(engine.model_path))
    ref = teacher_forced_logprobs(base, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
    assert t.logprobs == pytest.approx(ref, abs=1e-4)


def test_vllm_client_publishes_a_policy_to_loom_engine(
    vllm_engine: Any, store: PolicyStore, model_dir: Path, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    ids = tokenizer.encode("policy", add_special_tokens=False)
    policy = store.get(1)
    assert policy is not None
    try:
        arun(vllm_engine.load_policy(policy))
        assert vllm_engine.policy_version == 1
        (c,) = arun(vllm_engine.generate(ids, SamplingParams(max_tokens=6, seed=0)))
        ref = teacher_forced_logprobs(load_model(store.path_of(1)), ids + c.token_ids, len(ids))
        assert c.logprobs == pytest.approx(ref, abs=1e-4)
    finally:  # put the session's model back for the other tests
        base = policy.model_copy(update={"version": 0, "path": str(model_dir)})
        arun(vllm_engine.load_policy(base))
    (c,) = arun(vllm_engine.generate(ids, SamplingParams(max_tokens=6, seed=0)))
    ref = teacher_forced_logprobs(reference_model, ids + c.token_ids, len(ids))
    assert c.logprobs == pytest.approx(ref, abs=1e-4)


def test_concurrent_requests_for_a_new_version_load_it_once_and_generate_from_it(
    torch_engine: Any, store: PolicyStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rollout worker with several task threads: every group asks the engine for the new version at
    once (rollout.catch_up). The loads are serialised (from_pretrained is not thread-safe: concurrent
    loads in a threads-pool worker left a model on the "meta" device) and the version loads once."""
    import threading

    import rollout_svc.engines.torch.engine as te

    engine = TorchEngine(torch_engine.model_path, model=torch_engine.model, tokenizer=torch_engine.tokenizer)
    policy = store.get(1)
    assert policy is not None
    loads: list[str] = []

    def counting_load(path: Any, device: str = "cpu") -> Any:
        loads.append(str(path))
        return load_model(path, device)

    monkeypatch.setattr(te, "load_model", counting_load)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            engine.load_policy_sync(policy)
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and loads == [str(policy.path)] and engine.policy_version == 1
    device = next(torch_engine.model.parameters()).device  # the version loads where the engine runs
    assert all(p.device == device for p in engine.model.parameters())
    ids = engine.tokenizer.encode("policy", add_special_tokens=False)
    (c,) = engine.generate_sync(ids, SamplingParams(max_tokens=6, seed=0))
    ref = teacher_forced_logprobs(load_model(store.path_of(1)), ids + c.token_ids, len(ids))
    assert c.logprobs == pytest.approx(ref, abs=1e-4)


def test_groups_in_flight_catch_up_one_at_a_time_and_never_load_an_older_version_over_a_newer(
    torch_engine: Any, store: PolicyStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.catch_up: groups sharing a replica's event loop (threads-pool tasks, API requests) ask
    for versions 2, 2 and 1 at once: version 2 loads once, and version 1 is not loaded over it."""
    import asyncio

    import rollout_svc.engines.torch.engine as te
    from rollout_svc.rollout import catch_up

    store.publish(2, lambda d: build_model_dir(d, seed=2))
    engine = TorchEngine(torch_engine.model_path, model=torch_engine.model, tokenizer=torch_engine.tokenizer)
    loads: list[str] = []

    def counting_load(path: Any, device: str = "cpu") -> Any:
        loads.append(str(path))
        return load_model(path, device)

    monkeypatch.setattr(te, "load_model", counting_load)
    settings = Settings(data_dir=tmp_path / "data", policy_store=store.root)

    async def three() -> None:
        await asyncio.gather(*(catch_up(engine, v, settings) for v in (2, 2, 1)))

    asyncio.run(three())
    assert loads == [str(store.path_of(2))] and engine.policy_version == 2


@pytest.mark.parametrize("ids", [[99999], [-3], [10**30], [5, 6, 10**6]])
def test_prompt_ids_outside_the_vocabulary_are_422_naming_the_field(client: Any, ids: list[int]) -> None:
    c, engine = client
    r = c.post("/v1/rollouts", json={"prompt_ids": ids, "sampling": {"max_tokens": 4}})
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"] == "invalid_prompt" and body["field"] == "prompt_ids"
    assert f"prompt_ids[{len(ids) - 1}]" in body["detail"] and f"[0, {engine.vocab_size})" in body["detail"]


def test_a_prompt_the_context_cannot_hold_is_422_naming_the_field(client: Any) -> None:
    c, engine = client
    limit = engine.max_model_len
    r = c.post("/v1/rollouts", json={"prompt_ids": [5] * limit, "sampling": {"max_tokens": 1}})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "prompt_ids" and f"context holds {limit}" in r.json()["detail"]
    r = c.post("/v1/rollouts", json={"prompt": "a" * (limit + 10), "sampling": {"max_tokens": 1}})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "prompt" and r.json()["error"] == "invalid_prompt"


def test_generation_stops_at_the_end_of_the_context_with_finish_reason_length(client: Any) -> None:
    """max_tokens is capped at the room the context leaves (vLLM would answer 400 instead)."""
    c, engine = client
    room = 3
    body = {
        "prompt_ids": [5] * (engine.max_model_len - room),
        "sampling": {"n": 4, "max_tokens": 8, "seed": 3},
    }
    r = c.post("/v1/rollouts", json=body)
    assert r.status_code == 200, r.text
    trajectories = Group.model_validate(r.json()).trajectories
    assert all(len(t.completion_ids) <= room for t in trajectories)
    full = [t for t in trajectories if len(t.completion_ids) == room]
    assert full and all(t.finish_reason == "length" for t in full)


def test_a_policy_path_outside_the_store_is_refused_and_a_bad_version_is_422(
    client: Any, store: PolicyStore, tmp_path: Path
) -> None:
    """Only the store's version directories are loaded; any other path gets one answer whether it
    exists or not, and a version that does not load says which version, not why."""
    c, _ = client
    answers = set()
    for path in (str(tmp_path), str(tmp_path / "missing"), "../../etc", "/etc/passwd", "v1/../../v1"):
        r = c.post("/v1/policy", json={"path": path})
        assert r.status_code == 422 and r.json()["error"] == "path_refused", r.text
        answers.add(r.text)
    assert len(answers) == 1
    assert c.post("/v1/policy", json={"path": str(store.path_of(1))}).json()["policy_version"] == 1
    store.publish(2, lambda d: (d / "config.json").write_text("not a checkpoint"))
    r = c.post("/v1/policy", json={"version": 2})
    assert r.status_code == 422 and r.json()["error"] == "load_failed", r.text
    assert "config" not in r.text and str(store.root) not in r.text
    r = c.post("/v1/rollouts", json={"prompt": "hi", "sampling": {"max_tokens": 2}, "policy_version": 1})
    assert r.status_code == 200  # the engine still serves its model


def test_a_remote_policy_store_that_does_not_answer_is_a_503(client: Any, tmp_path: Path) -> None:
    """With LOOM_POLICY_STORE_URL a load pulls over HTTP: a store that refuses the connection is a typed
    503 naming the store, not a 500, and the engine keeps the policy it had."""
    import socket

    from rollout_svc.api import app

    c, engine = client
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app.state.settings = Settings(
        data_dir=tmp_path / "data",
        policy_store_url=f"http://127.0.0.1:{port}",
        policy_pull_timeout_s=5,
    )
    before = engine.policy_version
    r = c.post("/v1/policy", json={"version": 1})
    assert r.status_code == 503, r.text
    assert r.json()["error"] == "policy_store_unavailable"
    assert engine.policy_version == before
