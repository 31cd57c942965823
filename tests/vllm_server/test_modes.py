"""Every rollout mode over ``POST /v1/rollouts`` of a rollout service (``loom api rollout``, its own
process) whose engine is the real vLLM (``LOOM_ENGINE=vllm``): plain, streaming (interleaved layout),
tree (entropy branching, and attention branching scored by ``loom engine`` at ``LOOM_ATTENTION_URL``)
and spawn. Every trained token's log-prob is the learner's recomputation of it; a policy version asked
for is loaded from the store first (``POST /v1/policy`` and ``policy_version``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.contracts.wire import Group
from loom.store import PolicyStore
from tests.rollout.conftest import start_engine_server, stop_process
from tests.vllm_server.conftest import TINY, changed_checkpoint, free_port, max_diff, reference_logprobs
from zoo.tiny import STREAM_HEADER, make_problems, plain_prompt, reflect_prompt, spawn_prompt
from zoo.tiny.traces import stream_sentences

ATOL = 1e-4
REPO = Path(__file__).resolve().parents[2]
PROBLEM = make_problems("arith", 1, seed=1)[0]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> PolicyStore:
    s = PolicyStore(tmp_path_factory.mktemp("modes-policy"))
    s.publish(1, lambda d: changed_checkpoint(d, seed=31) and None)
    return s


@pytest.fixture(scope="module")
def rollout_api(
    vllm: Any, store: PolicyStore, scorer: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = free_port()
    data = tmp_path_factory.mktemp("rollout-data")
    env = {
        **os.environ,
        "LOOM_ENGINE": "vllm",
        "LOOM_ENGINE_URL": vllm.ensure("raw"),
        "LOOM_MODEL": "tiny",  # the tokenizer the service reads text with
        "LOOM_DATA_DIR": str(data),
        "LOOM_POLICY_STORE": str(store.root),
        "LOOM_TORCH_THREADS": "1",
        "LOOM_ATTENTION_URL": scorer,  # the operator's attention scorer (requests cannot name one)
    }
    log = (data / "rollout.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "api", "rollout", "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (data / "rollout.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the rollout service did not start"
            time.sleep(0.3)
        yield url
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture(scope="module")
def scorer() -> Iterator[str]:
    """``loom engine`` on the same tiny model: the attention scorer tree mode calls."""
    proc, url = start_engine_server(["--model", "tiny"])
    try:
        yield url
    finally:
        stop_process(proc)


def _rollout(url: str, body: dict[str, Any]) -> Group:
    r = httpx.post(f"{url}/v1/rollouts", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return Group.model_validate(r.json())


def _assert_trained_tokens_exact(group: Group, path: Path | str) -> None:
    for t in group.trajectories:
        assert t.engine == "vllm" and t.logprobs is not None
        mask = t.loss_mask or [1] * len(t.completion_ids)
        trained = [i for i, m in enumerate(mask) if m]
        if not trained:
            continue
        ref = reference_logprobs(path, t.prompt_ids, t.completion_ids)
        assert max_diff([t.logprobs[i] for i in trained], [ref[i] for i in trained]) < ATOL, t.id


def test_plain(rollout_api: str) -> None:
    body = {"prompt": plain_prompt(PROBLEM), "sampling": {"n": 4, "max_tokens": 48, "seed": 1}}
    group = _rollout(rollout_api, body)
    assert group.mode == "plain" and len(group.trajectories) == 4
    _assert_trained_tokens_exact(group, TINY)


def test_streaming_interleaved(rollout_api: str) -> None:
    body = {
        "mode": "streaming",
        "prompt": STREAM_HEADER,
        "sampling": {"n": 2, "max_tokens": 64, "seed": 2},
        "mode_params": {"sentences": stream_sentences(PROBLEM), "layout": "interleaved"},
    }
    group = _rollout(rollout_api, body)
    assert group.mode == "streaming" and len(group.trajectories) == 2
    for t in group.trajectories:
        assert t.loss_mask is not None and 0 in t.loss_mask  # the revealed sentences are not trained
        assert {s.kind for s in t.segments} >= {"observation", "stream"}
    _assert_trained_tokens_exact(group, TINY)


def test_streaming_group_positions_is_a_422_naming_the_capability(rollout_api: str) -> None:
    body = {
        "mode": "streaming",
        "prompt": STREAM_HEADER,
        "sampling": {"n": 1, "max_tokens": 16},
        "mode_params": {"sentences": stream_sentences(PROBLEM), "layout": "group_positions"},
    }
    r = httpx.post(f"{rollout_api}/v1/rollouts", json=body, timeout=120)
    assert r.status_code == 422 and "group_positions" in r.text


@pytest.mark.parametrize("strategy", ["entropy", "attention"])
def test_tree(rollout_api: str, strategy: str) -> None:
    params: dict[str, Any] = {"initial": 3, "strategy": strategy, "min_distance": 4, "delta": 2}
    body = {
        "mode": "tree",
        "prompt": reflect_prompt(PROBLEM),
        "sampling": {"max_tokens": 96, "seed": 5},
        "mode_params": params,
    }
    group = _rollout(rollout_api, body)
    assert group.mode == "tree" and group.tree
    assert len(group.trajectories) > 3 and group.meta["n_leaves"] == len(group.trajectories)
    assert any(t.parent_id for t in group.trajectories)  # branches
    if strategy == "attention":
        assert group.meta["fci"]
    _assert_trained_tokens_exact(group, TINY)


def test_spawn(rollout_api: str) -> None:
    body = {
        "mode": "spawn",
        "prompt": spawn_prompt(PROBLEM),
        "sampling": {"n": 1, "max_tokens": 200, "temperature": 0.0},
    }
    group = _rollout(rollout_api, body)
    assert group.mode == "spawn" and group.trajectories
    _assert_trained_tokens_exact(group, TINY)


def test_a_request_for_a_policy_version_loads_it_from_the_store_first(
    rollout_api: str, store: PolicyStore, vllm: Any
) -> None:
    v1 = store.get(1)
    assert v1 is not None
    body = {
        "prompt": plain_prompt(PROBLEM),
        "sampling": {"n": 2, "max_tokens": 32, "seed": 3},
        "policy_version": 1,
    }
    try:
        group = _rollout(rollout_api, body)
        assert {t.policy_version for t in group.trajectories} == {1}
        _assert_trained_tokens_exact(group, v1.path)
        bad = httpx.post(f"{rollout_api}/v1/policy", json={"path": "/no/such/checkpoint"}, timeout=120)
        assert bad.status_code == 422 and bad.json()["error"] == "path_refused"
        missing = httpx.post(f"{rollout_api}/v1/policy", json={"version": 9}, timeout=120)
        assert missing.status_code == 404 and missing.json()["error"] == "not_found"
    finally:  # the base model back for the other tests
        r = httpx.post(f"{rollout_api}/v1/policy", json={"version": 0}, timeout=120)
        assert r.status_code == 200, r.text
