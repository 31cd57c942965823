import pytest
from pydantic import ValidationError

from loom.contracts.wire import Group, RolloutRequest, Segment, Trajectory


def traj(**kw):
    base = dict(id="t0", group_id="g0", prompt_ids=[1, 2], completion_ids=[3, 4, 5])
    base.update(kw)
    return Trajectory(**base)


def test_per_token_lists_must_align_with_completion():
    traj(logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 0, 1])
    with pytest.raises(ValidationError, match="logprobs has 2 entries"):
        traj(logprobs=[-0.1, -0.2])
    with pytest.raises(ValidationError, match="loss_mask"):
        traj(loss_mask=[1, 1])
    with pytest.raises(ValidationError, match="0 or 1"):
        traj(loss_mask=[1, 2, 1])


def test_segments_must_lie_inside_the_completion():
    traj(segments=[Segment(kind="stream", start=0, end=3)])
    with pytest.raises(ValidationError, match="exceeds 3"):
        traj(segments=[Segment(kind="deep", start=1, end=4)])
    with pytest.raises(ValidationError):
        Segment(kind="deep", start=3, end=1)


def test_group_members_share_its_id():
    Group(id="g0", trajectories=[traj()])
    with pytest.raises(ValidationError, match="group_id"):
        Group(id="g1", trajectories=[traj()])


def test_unknown_fields_are_refused_with_their_name():
    with pytest.raises(ValidationError) as err:
        RolloutRequest(prompt="2+2=", temprature=0.5)  # type: ignore[call-arg]
    assert err.value.errors()[0]["loc"] == ("temprature",)


def test_nan_and_infinite_numbers_are_refused_with_their_field():
    from loom.contracts.wire import LossSpec, TrajectoryReward

    for bad in ('{"trajectory_id": "t", "total": NaN}', '{"trajectory_id": "t", "total": Infinity}'):
        with pytest.raises(ValidationError) as err:
            TrajectoryReward.model_validate_json(bad)
        assert err.value.errors()[0]["loc"] == ("total",)
    with pytest.raises(ValidationError) as err:
        TrajectoryReward(trajectory_id="t", total=1.0, components={"accuracy": float("nan")})
    assert err.value.errors()[0]["loc"] == ("components", "accuracy")
    with pytest.raises(ValidationError) as err:
        traj(logprobs=[-0.1, float("-inf"), -0.3])
    assert err.value.errors()[0]["loc"] == ("logprobs", 1)
    with pytest.raises(ValidationError):
        LossSpec(lr=float("inf"))
    # free-form parameter dicts too, at any depth
    with pytest.raises(ValidationError, match=r"a\[1\]\.b must be a finite number"):
        RolloutRequest(prompt="p", mode="tree", mode_params={"a": [1, {"b": float("nan")}]})


def test_rollout_request_needs_exactly_one_prompt():
    RolloutRequest(prompt_ids=[1, 2, 3])
    with pytest.raises(ValidationError, match="exactly one"):
        RolloutRequest()
    with pytest.raises(ValidationError, match="exactly one"):
        RolloutRequest(prompt="x", prompt_ids=[1])
