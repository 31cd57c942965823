"""Rollouts at a (namespace, version) on the real torch engine: a replica loads the policy a request
names before generating, "exact" gets that version even when the replica holds a newer one, and every
trajectory carries the policy it was generated with (checked against that policy's own weights)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from loom.contracts.settings import Settings
from loom.contracts.wire import Group, RolloutRequest, SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines.torch import TorchEngine, load_model, teacher_forced_logprobs
from rollout_svc.modes import ModeError
from rollout_svc.rollout import generate_group
from tests.rollout.conftest import build_model_dir, engine_server, model_dir  # noqa: F401 (fixtures)

PROMPT = "1 + 1 = ?"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Settings]:
    """A base model, the learner's version 1 and alice's versions 1 and 2: four different weights."""
    root = tmp_path_factory.mktemp("at-version")
    base = build_model_dir(root / "base", seed=0)
    store = PolicyStore(root / "policy")
    store.publish(1, lambda d: build_model_dir(d, seed=1))
    alice = store.namespace("alice")
    alice.publish(1, lambda d: build_model_dir(d, seed=21))
    alice.publish(2, lambda d: build_model_dir(d, seed=22))
    settings = Settings(data_dir=root / "data", policy_store=store.root, model=str(base), torch_threads=1)
    return base, settings


def engine_of(base: Path) -> TorchEngine:
    return TorchEngine(base, device="cpu")


def request(version: int | None, namespace: str | None = None, match: str = "at_least") -> RolloutRequest:
    return RolloutRequest.model_validate(
        {
            "prompt": PROMPT,
            "sampling": {"n": 2, "max_tokens": 6, "seed": 3},
            "policy_version": version,
            "policy_namespace": namespace,
            "policy_match": match,
        }
    )


def generated_by(group: Group, engine: TorchEngine, weights: Path) -> bool:
    """Every trajectory's log-probs are those of the checkpoint at ``weights`` (teacher-forced)."""
    model = load_model(weights)
    for t in group.trajectories:
        ref = teacher_forced_logprobs(model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
        if t.logprobs != pytest.approx(ref, abs=1e-4):
            return False
    return True


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_exact_gets_that_version_even_when_the_replica_holds_a_newer_one(world: Any) -> None:
    base, settings = world
    engine = engine_of(base)
    alice = PolicyStore(settings.policy_store_path, create=False).namespace("alice")

    async def flow() -> list[Group]:
        tok = lambda: engine.tokenizer  # noqa: E731
        newest = await generate_group(request(2, "alice"), engine, tok, settings)
        older_ok = await generate_group(request(1, "alice"), engine, tok, settings)  # at least 1: keeps 2
        exact = await generate_group(request(1, "alice", "exact"), engine, tok, settings)
        learners = await generate_group(request(1), engine, tok, settings)  # another namespace: loads it
        return [newest, older_ok, exact, learners]

    newest, older_ok, exact, learners = run(flow())
    seen = [
        {(t.policy_namespace, t.policy_version) for t in g.trajectories}
        for g in (newest, older_ok, exact, learners)
    ]
    assert seen == [{("alice", 2)}, {("alice", 2)}, {("alice", 1)}, {(None, 1)}]
    assert generated_by(exact, engine, alice.path_of(1)) and not generated_by(exact, engine, alice.path_of(2))
    assert generated_by(older_ok, engine, alice.path_of(2))
    assert generated_by(learners, engine, settings.policy_store_path / "v1")


def test_groups_in_flight_at_different_policies_never_mix(world: Any) -> None:
    """Groups sharing the replica's event loop ask for three different policies at once: each is
    generated whole by the one it names (a load waits for the groups generating to end)."""
    base, settings = world
    engine = engine_of(base)
    store = PolicyStore(settings.policy_store_path, create=False)
    wanted = [(2, "alice", "at_least"), (1, None, "at_least"), (1, "alice", "exact"), (2, "alice", "exact")]

    async def together() -> list[Group]:
        tok = lambda: engine.tokenizer  # noqa: E731
        return list(
            await asyncio.gather(*(generate_group(request(*w), engine, tok, settings) for w in wanted))
        )

    groups = run(together())
    for (version, namespace, _), group in zip(wanted, groups, strict=True):
        assert {(t.policy_namespace, t.policy_version) for t in group.trajectories} == {(namespace, version)}
        assert generated_by(group, engine, store.namespace(namespace).path_of(version))


def test_a_version_a_namespace_does_not_hold_is_an_error_not_another_policy(world: Any) -> None:
    base, settings = world
    engine = engine_of(base)
    tok = lambda: engine.tokenizer  # noqa: E731
    with pytest.raises(ModeError, match="policy version 3 is not in policy namespace 'alice'"):
        run(generate_group(request(3, "alice"), engine, tok, settings))
    with pytest.raises(ModeError, match="namespace 'bob'"):
        run(generate_group(request(1, "bob"), engine, tok, settings))
    assert (engine.policy_version, engine.policy_namespace) == (0, None)


def test_the_policy_load_route_names_a_trainers_version_by_its_namespace(world: Any) -> None:
    """rollout_svc/api.py ``POST /v1/policy`` (``stored_policy``): a namespace's version by number or
    by its folder; a folder of another namespace, or a name that is no namespace, is refused."""
    from rollout_svc.rollout import PolicyNotFound, PolicyPathRefused, stored_policy

    _, settings = world
    alice = PolicyStore(settings.policy_store_path, create=False).namespace("alice")
    found = stored_policy(settings, 1, namespace="alice")
    assert (found.namespace, found.version, found.path) == ("alice", 1, str(alice.path_of(1)))
    assert stored_policy(settings, None, str(alice.path_of(2)), namespace="alice").version == 2
    assert stored_policy(settings, None, namespace="alice").version == 2  # its newest
    with pytest.raises(PolicyPathRefused):
        stored_policy(settings, None, str(alice.path_of(2)))  # not a folder of the learner's store
    for name in ("../alice", "bob"):
        with pytest.raises(PolicyNotFound):
            stored_policy(settings, 1, namespace=name)


def test_the_vllm_client_loads_a_trainers_version_and_a_fresh_client_recognises_it(
    world: Any,
    engine_server: str,  # noqa: F811 (the fixture imported above)
    model_dir: Path,  # noqa: F811
) -> None:
    """The vLLM client (against ``loom engine``, which speaks vLLM's reload and label routes): a
    request at alice's version 1 reloads the server from alice's folder, the trajectories carry it,
    and a fresh client of the same store reads the server's label back as (alice, 1)."""
    from transformers import AutoTokenizer

    from rollout_svc.engines.vllm import VLLMEngine

    _, settings = world
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store = settings.policy_store_path

    async def flow() -> tuple[Group, tuple[int, str | None]]:
        engine = VLLMEngine(engine_server, policy_store=store, retries=1)
        fresh = VLLMEngine(engine_server, policy_store=store, retries=1)
        try:
            group = await generate_group(request(1, "alice", "exact"), engine, lambda: tokenizer, settings)
            await fresh.generate([5, 6, 7], SamplingParams(max_tokens=2))
            return group, (fresh.policy_version, fresh.policy_namespace)
        finally:
            await engine.close()
            await fresh.close()

    group, recognised = run(flow())
    assert {(t.policy_namespace, t.policy_version) for t in group.trajectories} == {("alice", 1)}
    assert recognised == (1, "alice")


def test_a_registered_version_is_checked_against_its_hashes_before_a_replica_loads_it(
    world: Any, tmp_path: Path
) -> None:
    """A registered path stays the trainer's: a replica reading it directly re-hashes it first, and a
    file changed since the registration is a load error, not a silently different policy."""
    from loom.contracts.policies import RegisterRequest
    from loom.store.uploads import Uploads
    from rollout_svc.engines.base import PolicyLoadError

    base, world_settings = world
    shared = build_model_dir(tmp_path / "shared" / "step-7", seed=7)
    store = PolicyStore(tmp_path / "policy")
    uploads = Uploads(store, max_bytes=10**9, ttl_s=3600)
    ref = uploads.register("alice", RegisterRequest(path=str(shared)), [tmp_path / "shared"])
    settings = world_settings.model_copy(update={"policy_store": store.root})
    engine = engine_of(base)
    group = run(
        generate_group(request(ref.version, "alice", "exact"), engine, lambda: engine.tokenizer, settings)
    )
    assert {(t.policy_namespace, t.policy_version) for t in group.trajectories} == {("alice", 1)}
    assert generated_by(group, engine, shared)
    (shared / "config.json").write_text((shared / "config.json").read_text().replace("{", "{ ", 1))
    fresh = engine_of(base)
    with pytest.raises(PolicyLoadError, match="config.json"):
        run(generate_group(request(1, "alice", "exact"), fresh, lambda: fresh.tokenizer, settings))
    assert fresh.policy_version == 0
