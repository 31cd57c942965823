"""The estimator_params contract: one typed model per estimator, unknown keys named, defaults once."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest
from pydantic import ValidationError

import loom.contracts.estimators as contract
from loom.contracts.estimators import (
    ESTIMATOR_PARAMS,
    EstimatorParams,
    GlobalBaselineParams,
    HrpoNames,
    HrpoParams,
    check_estimator_params,
    estimator_params,
)
from loom.contracts.wire import Estimator


def test_every_estimator_has_one_params_model() -> None:
    assert set(ESTIMATOR_PARAMS) == set(typing.get_args(Estimator))
    assert all(issubclass(m, EstimatorParams) for m in ESTIMATOR_PARAMS.values())


def test_defaults_are_the_papers() -> None:
    p = HrpoParams()
    assert (p.eps, p.beta, p.w_acc, p.w_fmt, p.mask_length_by_format) == (1e-6, 0.05, 1.0, 2.0, True)
    assert p.names == HrpoNames() and p.names.efficiency == "efficiency"
    assert GlobalBaselineParams().std is False
    assert EstimatorParams().reward_key is None and EstimatorParams().batch_lambda == 0.9


@pytest.mark.parametrize(
    ("estimator", "params", "named"),
    [
        ("grpo", {"epsilon": 1e-6}, "epsilon"),
        ("hrpo", {"betta": 0.1}, "betta"),
        ("grpo", {"std": True}, "std"),  # global_baseline's, not grpo's
        ("grpo", {"threshold": 0.7}, "threshold"),  # adaptive sampling's, read by no estimator
    ],
)
def test_unknown_keys_are_refused_by_name(estimator: str, params: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=rf"\['{named}'\] are not read by estimator '{estimator}'"):
        check_estimator_params(estimator, params)
    with pytest.raises(ValueError, match="not read by estimator"):
        estimator_params(estimator, params)


def test_known_keys_are_typed_when_read() -> None:
    p = estimator_params("global_baseline", {"std": 1, "reward_key": "total", "eps": 1})
    assert isinstance(p, GlobalBaselineParams) and p.std is True and p.eps == 1.0
    names = estimator_params("hrpo", {"names": {"accuracy": "acc"}})
    assert isinstance(names, HrpoParams) and names.names.accuracy == "acc"
    for params in (
        {"eps": [1]},
        {"names": [1]},
        {"beta": {}},
        {"names": {"acc": "x"}},
        {"eps": float("nan")},
    ):
        check_estimator_params("hrpo", params)  # the keys are known ...
        with pytest.raises(ValidationError):  # ... the values are not what HRPO reads
            estimator_params("hrpo", params)


def test_the_contract_imports_only_pydantic_and_the_standard_library() -> None:
    tree = ast.parse(Path(contract.__file__).read_text())
    roots: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            roots |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            roots.add((n.module or "").split(".")[0])
    assert roots <= {"__future__", "collections", "typing", "pydantic", "loom"}, roots


def _batch(**kw: typing.Any) -> typing.Any:
    from loom.contracts.wire import Group, RewardResult, TrainBatch, Trajectory

    g = Group(id="g", trajectories=[Trajectory(id="t", group_id="g", prompt_ids=[1], completion_ids=[2])])
    return TrainBatch(step=0, groups=[g], rewards=[RewardResult(group_id="g", rewards=[])], **kw)


def test_the_wire_parses_a_plain_object_into_the_estimators_own_model() -> None:
    """Estimator params are a discriminated union keyed by the estimator: a JSON object as ever in,
    the estimator's typed model out, and the same object (every field, no tag) written back."""
    batch = _batch(estimator="hrpo", estimator_params={"beta": 0.1, "names": {"accuracy": "acc"}})
    p = batch.estimator_params
    assert isinstance(p, HrpoParams) and (p.beta, p.names.accuracy, p.w_fmt) == (0.1, "acc", 2.0)
    written = batch.model_dump(mode="json")["estimator_params"]
    assert (
        contract.TAG not in written
        and written == HrpoParams(beta=0.1, names={"accuracy": "acc"}).model_dump()
    )
    again = type(batch).model_validate_json(batch.model_dump_json())
    assert again.estimator_params == p and isinstance(again.estimator_params, HrpoParams)
    assert isinstance(_batch().estimator_params, contract.GrpoParams)  # none given: grpo's defaults
    with pytest.raises(ValidationError) as err:
        _batch(estimator="hrpo", estimator_params={"beta": "high"})
    assert err.value.errors()[0]["loc"] == ("estimator_params", "hrpo", "beta")
    with pytest.raises(ValidationError, match="not read by estimator 'grpo'"):
        _batch(estimator="grpo", estimator_params=p)  # another estimator's params
    # the schema shows the tag: a client may send it, the estimator's own name only
    tagged = _batch(estimator="hrpo", estimator_params={"estimator": "hrpo", "beta": 0.2}).estimator_params
    assert isinstance(tagged, HrpoParams) and tagged.beta == 0.2
    with pytest.raises(ValidationError, match="must be the estimator, 'grpo'"):
        _batch(estimator="grpo", estimator_params={"estimator": "hrpo"})


def test_the_schema_names_each_estimators_params_by_its_tag() -> None:
    from loom.contracts.wire import TrainBatch

    schema = TrainBatch.model_json_schema()
    union = schema["properties"]["estimator_params"]
    assert set(union["discriminator"]["mapping"]) == set(ESTIMATOR_PARAMS)
    hrpo = schema["$defs"][union["discriminator"]["mapping"]["hrpo"].rsplit("/", 1)[-1]]
    assert {"beta", "w_acc", "w_fmt", "names"} <= set(hrpo["properties"])
