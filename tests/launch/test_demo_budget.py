"""``loom demo``'s time budget (launch/demo.py): the run is stopped at ``--time-limit`` and the demo
reports what it trained; only a run that trained nothing, or failed, is a failed demo."""

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
