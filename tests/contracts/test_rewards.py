"""The reward components' contract (loom/contracts/rewards.py): names, defaults, the spec check."""

import subprocess
import sys

import pytest

from loom.contracts.reward_settings import RewardSettings, get_reward_settings
from loom.contracts.rewards import (
    ANSWER_TAIL_CHARS,
    COMPONENT_PARAMS,
    DEFAULT_DQ,
    AccuracyParams,
    ReflectionParams,
    RequestError,
    check_spec,
    check_timeout,
)
from loom.contracts.wire import RewardComponent, RewardSpec
from reward_svc.registry import NEEDS_ACCURACY, NEEDS_CODE, REGISTRY


def _spec(*components: dict, timeout_s: int = 5) -> RewardSpec:
    return RewardSpec(components=[RewardComponent(**c) for c in components], timeout_s=timeout_s)


def _error(spec: RewardSpec, **kw) -> RequestError:
    with pytest.raises(RequestError) as exc:
        check_spec(spec, **kw)
    return exc.value


def test_the_contract_names_the_registry_components():
    assert set(COMPONENT_PARAMS) == set(REGISTRY)
    assert NEEDS_ACCURACY == {"accuracy", "length_kimi", "length_refined", "efficiency"}
    assert NEEDS_CODE == {"code_pass", "code_all"}


def test_the_contract_imports_no_service():
    code = (
        "import sys, loom.contracts.rewards, gateway.validate;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('reward_svc', 'rollout_svc', 'reflect_svc')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_defaults_are_written_once():
    assert AccuracyParams().tail_chars == ANSWER_TAIL_CHARS
    assert ReflectionParams().fixed_value == DEFAULT_DQ


def test_a_valid_spec_passes():
    check_spec(_spec({"name": "accuracy"}, {"name": "reflection", "params": {"d_q": "running"}}))


def test_an_unknown_component_is_named_at_its_index():
    e = _error(_spec({"name": "accuracy"}, {"name": "nope"}))
    assert (e.status, e.loc) == (422, ["body", "spec", "components", 1, "name"])
    assert e.msg == f"unknown component 'nope'; known: {sorted(COMPONENT_PARAMS)}"


def test_a_bad_param_gets_its_path():
    e = _error(_spec({"name": "efficiency", "params": {"alpha": 2}}), loc=("body", "reward"))
    assert e.loc == ["body", "reward", "components", 0, "params", "alpha"]
    e = _error(_spec({"name": "format_think", "params": {"x": 1}}))
    assert e.loc == ["body", "spec", "components", 0, "params", "x"]


def test_a_non_finite_weight_is_refused():
    spec = RewardSpec.model_construct(
        components=[RewardComponent.model_construct(name="accuracy", weight=float("inf"), params={})],
        timeout_s=5,
    )
    assert _error(spec).loc == ["body", "spec", "components", 0, "weight"]


def test_each_component_appears_once():
    e = _error(_spec({"name": "accuracy"}, {"name": "accuracy", "weight": 2}))
    assert (e.loc, e.msg) == (["body", "spec", "components"], "each component may appear once")


def test_the_deadline_is_bounded_by_the_operator():
    e = _error(_spec({"name": "accuracy"}, timeout_s=11), max_timeout_s=10)
    assert e.loc == ["body", "spec", "timeout_s"] and "LOOM_REWARD_MAX_TIMEOUT_S" in e.msg
    check_spec(_spec({"name": "accuracy"}, timeout_s=10), max_timeout_s=10)
    bound = get_reward_settings().max_timeout_s
    with pytest.raises(RequestError):
        check_timeout(bound + 1, ["timeout_s"])
    check_timeout(bound, ["timeout_s"])


def test_the_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOOM_REWARD_MAX_TIMEOUT_S", "7")
    assert RewardSettings().max_timeout_s == 7


def test_error_bodies_keep_their_shape():
    assert RequestError(422, ["body", "x"], "bad").body() == {
        "error": "validation_error",
        "detail": [{"loc": ["body", "x"], "msg": "bad", "type": "validation_error"}],
    }
    assert RequestError(413, ["body", "groups"], "big").body()["error"] == "payload_too_large"


def test_component_schemas_are_the_fields_alone():
    # GET /v1/rewards/components serves these schemas: a class docstring would add a description
    assert all("description" not in m.model_json_schema() for m in COMPONENT_PARAMS.values())
