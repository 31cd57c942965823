from fractions import Fraction

import pytest

from loom.exact import ExprError, check_arithmetic, check_countdown, evaluate


def test_precedence_and_exact_division():
    assert evaluate("2 + 3 * 4").value == 14
    assert evaluate("(2 + 3) * 4").value == 20
    assert evaluate("7 / 2").value == Fraction(7, 2)
    assert evaluate("-3 + 5").value == 2
    assert evaluate("6 × 7").value == 42


@pytest.mark.parametrize(
    "bad",
    ["__import__('os')", "2 ** 1000", "1/0", "(" * 40 + "1" + ")" * 40, "9" * 40, "", "1 +", "2 3"],
)
def test_hostile_or_malformed_expressions_are_refused(bad):
    with pytest.raises(ExprError):
        evaluate(bad)


def test_countdown_needs_each_number_once_and_the_target():
    assert check_countdown("(8 - 2) * (3 + 4)", [8, 2, 3, 4], 42)
    assert check_countdown("(8 - 2) * (3 + 4) = 42", [2, 3, 4, 8], 42)
    assert not check_countdown("8 * 2 + 3 * 4", [8, 2, 3, 4], 42)  # 28
    assert not check_countdown("6 * 7", [8, 2, 3, 4], 42)  # numbers not given
    assert not check_countdown("8 * 4 + 8 + 2", [8, 2, 3, 4], 42)  # 8 used twice, 3 unused
    assert check_countdown("8 * 4 + 8 + 2", [8, 8, 4, 2], 42)


def test_arithmetic_answers_compare_by_value():
    assert check_arithmetic("42", "42")
    assert check_arithmetic(" 1,024 ", "1024")
    assert check_arithmetic("0.5", "1/2")
    assert not check_arithmetic("41", "42")
    assert not check_arithmetic("forty-two", "42")
