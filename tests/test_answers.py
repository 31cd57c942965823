"""One boxed-answer extractor for the reward service, tree mode and the tiny model (loom/answers.py)."""

from loom.answers import last_boxed


def test_last_boxed_takes_the_last_balanced_answer():
    assert last_boxed("x \\boxed{41} then \\boxed{(3*5)+7}") == "(3*5)+7"
    assert last_boxed("\\boxed{4") is None
    assert last_boxed("no answer") is None


def test_an_unclosed_trailing_box_does_not_hide_an_earlier_answer():
    assert last_boxed("\\boxed{42} then \\boxed{unclosed") == "42"
    assert last_boxed("\\boxed{42}" + " \\boxed{" * 8) is None  # only the last max_tries openings


def test_nested_braces_fbox_and_spacing_are_read():
    assert last_boxed("\\boxed{\\frac{8}{2}}") == "\\frac{8}{2}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed {7}") == "7"


def test_the_content_is_returned_as_written():
    assert last_boxed("\\boxed{ 132 }") == " 132 "
    assert last_boxed("\\boxed{}") == ""
