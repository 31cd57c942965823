"""The vllm client's policy-update contract against ``loom engine`` (which answers as vLLM does,
tests/rollout/test_control.py), so it holds where no vLLM environment exists; tests/vllm_server runs the
same against the real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from loom.contracts.wire import PolicyVersion, SamplingParams
from loom.store import PolicyStore
from rollout_svc.engines.base import EngineUnavailable, PolicyLoadError
from rollout_svc.engines.vllm import VLLMEngine, weight_label
from tests.rollout.conftest import build_model_dir


@pytest.fixture
def client(engine_server: str, model_dir: Path, arun: Any, tmp_path: Path) -> Any:
    engine = VLLMEngine(engine_server, policy_store=tmp_path / "store", retries=1)
    arun(engine.load_policy(PolicyVersion(version=0, path=str(model_dir))))
    yield engine
    arun(engine.close())


def test_a_missing_checkpoint_is_a_policy_load_error_not_a_retried_outage(
    client: VLLMEngine, arun: Any, tmp_path: Path
) -> None:
    params = SamplingParams(n=2, max_tokens=6, seed=2)
    before = arun(client.generate([5, 6, 7], params))
    with pytest.raises(PolicyLoadError) as err:
        arun(client.load_policy(PolicyVersion(version=3, path=str(tmp_path / "no-such-checkpoint"))))
    assert not isinstance(err.value, EngineUnavailable)
    after = arun(client.generate([5, 6, 7], params))
    assert [c.token_ids for c in after] == [c.token_ids for c in before] and client.policy_version == 0
    assert httpx.get(f"{client.base_url}/is_paused", timeout=10).json() == {"is_paused": False}


def test_an_update_marks_the_servers_weight_version(client: VLLMEngine, arun: Any, tmp_path: Path) -> None:
    store = PolicyStore(tmp_path / "store")
    v1 = store.publish(1, lambda d: build_model_dir(d, seed=1) and None)
    arun(client.load_policy(v1))
    label = httpx.get(f"{client.base_url}/weight_info", timeout=10).json()["weight_version"]
    assert json.loads(label) == json.loads(weight_label(v1)) and client.policy_version == 1


def test_a_fresh_client_reloads_weights_it_cannot_verify(
    engine_server: str, model_dir: Path, arun: Any, tmp_path: Path
) -> None:
    other = PolicyStore(tmp_path / "previous-run")
    v4 = other.publish(4, lambda d: build_model_dir(d, seed=4) and None)
    first = VLLMEngine(engine_server, policy_store=other.root)
    arun(first.load_policy(v4))
    arun(first.close())
    fresh = VLLMEngine(engine_server, policy_store=tmp_path / "this-run")
    try:
        arun(fresh.generate([5, 6, 7], SamplingParams(max_tokens=2)))
        assert fresh.policy_version == 0  # not the previous run's 4
        root = httpx.get(f"{engine_server}/v1/models", timeout=10).json()["data"][0]["root"]
        assert root == str(model_dir)  # the served model was loaded back
    finally:
        arun(fresh.close())


def test_a_stop_id_sequence_is_refused_before_any_request(arun: Any) -> None:
    """vLLM stops on single ids and on text, not on id sequences: a multi-token marker's stop is an
    ``UnsupportedCapability`` naming it (no server is asked: the address below serves nothing)."""
    from rollout_svc.engines.base import UnsupportedCapability

    engine = VLLMEngine("http://127.0.0.1:9", retries=1)
    assert "stop_sequences" not in engine.capabilities
    with pytest.raises(UnsupportedCapability, match="stop_sequences"):
        arun(engine.generate([1, 2], SamplingParams(stop_token_sequences=[[3, 4]])))
