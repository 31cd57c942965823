"""Rollouts at a trainer's ``(namespace, version)`` on the real vLLM (issue 34, docs/interop-rollout.md
"Rollouts at a version"): two trainers (keys ``alice`` and ``bob``) publish versions through a real
gateway with ``PolicyPublisher``; the gateway forwards them to the learner API's store; the replica
holds no store and pulls each version over HTTP into its cache (``LOOM_POLICY_STORE_URL``), as a
replica on another host does; the vllm client loads it into the session's vLLM server (a full reload,
or a LoRA adapter). ``exact`` gets the version named even when a newer one is held, ``at_least`` keeps
a newer one, every trajectory carries the policy it was generated with, and its behaviour log-probs
are the learner's recomputation with the trainer's own checkpoint (the bytes it published). Two
namespaces hold versions of the same number with different weights: neither is served for the other."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.clients.policies import PolicyPublisher
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, PolicyVersion, RolloutRequest
from rollout_svc.engines.vllm import VLLMEngine
from rollout_svc.modes import ModeError
from rollout_svc.rollout import generate_group
from tests.interop_rollout.conftest import (
    OTHER_KEY,
    PUBLISHER_KEY,
    TOKEN,
    gateway_settings,
    start_gateway,
    start_learner_api,
)
from tests.vllm_server.conftest import (
    SERVED,
    TINY,
    changed_checkpoint,
    max_diff,
    reference_logprobs,
    write_lora,
)

ATOL = 1e-4  # as the other tests/vllm_server tests: vLLM's CPU kernels against the HF forward, float32
CHANGED = 0.05  # another policy's log-probs differ from these by more than this (seen: > 0.3)


@dataclass
class World:
    replica: Settings  # the rollout replica's settings: the store over HTTP, a cache of its own
    full: dict[tuple[str, int], Path]  # (namespace, version) -> the trainer's checkpoint folder
    lora: dict[tuple[str, int], dict[str, Any]]  # (namespace, version) -> the adapter's A, B, scale


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """alice publishes full versions 1 and 2, bob a full version 1 (other weights, same number); each
    then publishes a LoRA adapter as version 3. The learner API (the store's host) stays up for the
    replica's pulls; the gateway only for the uploads."""
    root = tmp_path_factory.mktemp("ns-versions")
    learner = gateway_settings(root / "learner", model=str(TINY))  # what is published is of its shape
    with start_learner_api(learner) as store_host:
        gw = gateway_settings(root / "gw", policy_store_url=store_host.url, model=str(TINY))
        with start_gateway(gw) as gateway:
            publishers = {
                "alice": PolicyPublisher(gateway.url, PUBLISHER_KEY),
                "bob": PolicyPublisher(gateway.url, OTHER_KEY),
            }
            full: dict[tuple[str, int], Path] = {}
            for (who, version), seed in {("alice", 1): 101, ("alice", 2): 102, ("bob", 1): 201}.items():
                folder = changed_checkpoint(root / "trainer" / f"{who}-v{version}", seed=seed)
                ref = publishers[who].publish_dir(folder)
                assert (ref.namespace, ref.version, ref.kind) == (who, version, "full")
                full[(who, version)] = folder
            lora: dict[tuple[str, int], dict[str, Any]] = {}
            for who, seed in (("alice", 103), ("bob", 203)):
                folder = root / "trainer" / f"{who}-lora"
                lora[(who, 3)] = write_lora(folder, seed=seed)
                ref = publishers[who].publish_dir(folder, kind="lora", version=3)
                assert (ref.namespace, ref.version, ref.kind) == (who, 3, "lora")
        replica = Settings(
            data_dir=root / "replica",
            policy_store_url=store_host.url,
            policy_cache=root / "replica" / "cache",
            service_token=TOKEN,
            model=str(TINY),
        )
        yield World(replica, full, lora)


@pytest.fixture
def engine(vllm: Any, arun: Any, world: World) -> Iterator[VLLMEngine]:
    """A vllm client of the session's server, its store the replica's cache; on the base model."""
    base = PolicyVersion(version=0, path=str(TINY))
    e = VLLMEngine(vllm.ensure("raw"), policy_store=world.replica.policy_local_root, retries=1)
    arun(e.load_policy(base))
    try:
        yield e
    finally:
        for name in _models(e.base_url):  # leave the server as found: no adapter, the base weights
            if name != SERVED:
                httpx.post(f"{e.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
        arun(e.load_policy(base))
        arun(e.close())


def _models(url: str) -> list[str]:
    return [c["id"] for c in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]


def request(
    prompt_ids: list[int], version: int, namespace: str | None, match: str = "at_least"
) -> RolloutRequest:
    return RolloutRequest.model_validate(
        {
            "prompt_ids": prompt_ids,
            "sampling": {"n": 2, "max_tokens": 8, "seed": 5},
            "policy_version": version,
            "policy_namespace": namespace,
            "policy_match": match,
        }
    )


def diff(group: Group, path: Path | str, lora: dict[str, Any] | None = None) -> float:
    """The largest |behaviour - recomputed| log-prob over the group, recomputed with ``path``'s
    weights (and ``lora`` merged), as the learner recomputes them."""
    return max(
        max_diff(t.logprobs or [], reference_logprobs(path, t.prompt_ids, t.completion_ids, lora=lora))
        for t in group.trajectories
    )


def policies(group: Group) -> set[tuple[str | None, int | None]]:
    return {(t.policy_namespace, t.policy_version) for t in group.trajectories}


def test_exact_and_at_least_at_trainers_versions_pulled_over_http(
    engine: VLLMEngine, arun: Any, world: World, tokenizer: Any, prompt_ids: list[int]
) -> None:
    full, settings = world.full, world.replica

    def rollout(version: int, namespace: str, match: str = "at_least") -> Group:
        req = request(prompt_ids, version, namespace, match)
        return arun(generate_group(req, engine, lambda: tokenizer, settings))

    newest = rollout(2, "alice")
    assert policies(newest) == {("alice", 2)}
    assert diff(newest, full[("alice", 2)]) < ATOL
    assert diff(newest, TINY) > CHANGED

    kept = rollout(1, "alice")  # at least 1: the held version 2 serves it, nothing is reloaded
    assert policies(kept) == {("alice", 2)}
    assert diff(kept, full[("alice", 2)]) < ATOL

    exact = rollout(1, "alice", "exact")  # exactly 1, though 2 is held (and newer)
    assert policies(exact) == {("alice", 1)}
    assert diff(exact, full[("alice", 1)]) < ATOL
    assert diff(exact, full[("alice", 2)]) > CHANGED

    bobs = rollout(1, "bob", "exact")  # the same number in another namespace: other weights
    assert policies(bobs) == {("bob", 1)}
    assert diff(bobs, full[("bob", 1)]) < ATOL
    assert diff(bobs, full[("alice", 1)]) > CHANGED

    back = rollout(1, "alice")  # bob's 1 does not answer alice's "at least 1": alice's 1 is loaded
    assert policies(back) == {("alice", 1)}
    assert diff(back, full[("alice", 1)]) < ATOL

    # each version was pulled over HTTP into the replica's cache, under its namespace; the replica
    # holds no store of its own
    cache = settings.policy_cache_path
    for who, version in full:
        assert (cache / "ns" / who / f"v{version}" / "model.safetensors").read_bytes() == (
            full[(who, version)] / "model.safetensors"
        ).read_bytes()
    assert not settings.policy_store_path.exists()

    # a fresh client of the same cache reads the server's label back as alice's version 1, not bob's
    fresh = VLLMEngine(engine.base_url, policy_store=settings.policy_local_root, retries=1)
    try:
        again = arun(
            generate_group(request(prompt_ids, 1, "alice", "exact"), fresh, lambda: tokenizer, settings)
        )
        assert (fresh.policy_namespace, fresh.policy_version) == ("alice", 1)
        assert policies(again) == {("alice", 1)} and diff(again, full[("alice", 1)]) < ATOL
    finally:
        arun(fresh.close())


def test_a_version_a_namespace_does_not_hold_is_an_error_never_another_namespaces(
    engine: VLLMEngine, arun: Any, world: World, tokenizer: Any, prompt_ids: list[int]
) -> None:
    settings = world.replica
    arun(generate_group(request(prompt_ids, 2, "alice", "exact"), engine, lambda: tokenizer, settings))
    label = httpx.get(f"{engine.base_url}/weight_info", timeout=30).json()
    wanted = [
        (2, "bob", "exact", "policy version 2 is not in policy namespace 'bob'"),  # alice has a 2
        (4, "bob", "at_least", "policy version 4 is not in policy namespace 'bob'"),
        (1, None, "at_least", "policy version 1 is not in the policy store"),  # the learner has none
        (1, None, "exact", "policy version 1 is not in the policy store"),
        (1, "carol", "at_least", "policy version 1 is not in policy namespace 'carol'"),  # no versions
        (1, "../alice", "exact", "'../alice' is not a policy namespace"),
    ]
    for version, namespace, match, message in wanted:
        req = request(prompt_ids, version, namespace, match)
        with pytest.raises(ModeError, match=re.escape(message)):
            arun(generate_group(req, engine, lambda: tokenizer, settings))
    # the server still holds alice's 2, and serves it
    assert httpx.get(f"{engine.base_url}/weight_info", timeout=30).json() == label
    assert (engine.policy_namespace, engine.policy_version) == ("alice", 2)
    group = arun(generate_group(request(prompt_ids, 2, "alice"), engine, lambda: tokenizer, settings))
    assert policies(group) == {("alice", 2)} and diff(group, world.full[("alice", 2)]) < ATOL


def test_lora_versions_of_one_number_in_two_namespaces_apply_to_the_base_model(
    engine: VLLMEngine, arun: Any, world: World, tokenizer: Any, prompt_ids: list[int]
) -> None:
    """A LoRA version is an adapter of the base model (the torch engine merges it into its base,
    rollout_svc/engines/torch/model.py ``load_adapter``): loaded after a full version, vLLM must not
    apply it to that version's weights."""
    settings, lora = world.replica, world.lora

    def rollout(version: int, namespace: str, match: str = "exact") -> Group:
        req = request(prompt_ids, version, namespace, match)
        return arun(generate_group(req, engine, lambda: tokenizer, settings))

    full = rollout(2, "alice")  # the server's weights are alice's full version 2 first
    assert policies(full) == {("alice", 2)} and diff(full, world.full[("alice", 2)]) < ATOL

    alices = rollout(3, "alice")
    assert policies(alices) == {("alice", 3)}
    assert diff(alices, TINY, lora=lora[("alice", 3)]) < ATOL

    bobs = rollout(3, "bob")
    assert policies(bobs) == {("bob", 3)}
    assert diff(bobs, TINY, lora=lora[("bob", 3)]) < ATOL
    assert diff(bobs, TINY, lora=lora[("alice", 3)]) > CHANGED
    assert engine.model != SERVED and engine.model in _models(engine.base_url)

    older = rollout(2, "alice")  # back to a full version: requests name the served model again
    assert policies(older) == {("alice", 2)} and diff(older, world.full[("alice", 2)]) < ATOL
    assert engine.model == SERVED
