"""``loom demo``'s step timing: the mean gap between step records after the first step, its parts,
and the step in units of the reference loop."""

from __future__ import annotations

from launch.demo import reference_seconds, step_times


def test_the_step_time_leaves_the_first_step_out_and_reads_in_reference_units() -> None:
    rows = [
        {"time": t, "gen_seconds": 1.0, "train_seconds": 0.5, "wait_gen_seconds": 0.0}
        for t in (100.0, 130.0, 132.0, 134.0)
    ]
    text = step_times(rows, reference=0.5)
    assert text.startswith("step time 2.00 s (generation 1.00 s, training 0.50 s")
    assert "4.0 reference units a step" in text
    assert step_times(rows[:2], 0.5) == "step time: too few steps to time"


def test_the_reference_loop_takes_measurable_time() -> None:
    assert 0.0 < reference_seconds(reps=1) < 60.0
