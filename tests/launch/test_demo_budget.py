"""``loom demo``'s time budget (launch/demo.py): the run is stopped at ``--time-limit`` and the demo
reports what it trained; only a run that trained nothing, or failed, is a failed demo. Its run
request carries the flags (``--filter-groups``)."""

import pytest

from launch.demo import finished, parse_args


def test_a_run_stopped_at_the_budget_after_training_is_a_finished_demo():
    assert finished("time_budget", [{"step": 0, "reward_mean": 0.4}])
    assert finished("succeeded", [{"step": 0}])


def test_a_run_that_trained_nothing_or_failed_is_not():
    assert not finished("time_budget", [])
    assert not finished("failed", [{"step": 0}])
    assert not finished("cancelled", [{"step": 0}])


def test_the_defaults_train_up_to_400_steps_within_the_budget():
    args = parse_args([])
    assert (args.steps, args.time_limit, args.lr, args.batch_size) == (400, 540.0, 1e-4, 16)


def test_the_filter_groups_flag_reaches_the_run_request_and_is_checked_there():
    from gateway.models import RunRequest
    from launch.demo import run_request

    body = run_request(parse_args(["--filter-groups", "accuracy"]))
    assert RunRequest.model_validate(body).filter_groups == "accuracy"
    assert "filter_groups" not in run_request(parse_args([]))
    with pytest.raises(ValueError, match="filter_groups"):  # not a component of the plain demo's reward
        RunRequest.model_validate(run_request(parse_args(["--filter-groups", "format_stream"])))
