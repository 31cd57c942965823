from fractions import Fraction

import pytest

from loom.exact import (
    MAX_NUMBER_CHARS,
    ExprError,
    check_arithmetic,
    check_countdown,
    evaluate,
    parse_countdown,
    parse_number,
)


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


@pytest.mark.parametrize("digits", [5000, 1000, MAX_NUMBER_CHARS + 1])
def test_overlong_numbers_are_not_numbers(digits):
    # Fraction("1" * 5000) raised ValueError (Python's 4300-digit limit for int())
    assert parse_number("1" * digits) is None
    assert parse_number("1." + "1" * digits) is None
    assert not check_arithmetic("1" * digits, "3") and not check_arithmetic("3", "1" * digits)


def test_long_numbers_within_the_limit_compare_exactly():
    n = "9" * (MAX_NUMBER_CHARS - 2)
    assert parse_number(n) == int(n)
    assert check_arithmetic(n + ".0", n)


@pytest.mark.parametrize(
    "spec",
    [
        "[" * 5000,  # json.loads: RecursionError
        '{"numbers": [1, 2], "target": Infinity}',  # int(inf): OverflowError
        {"numbers": [1, 2], "target": float("nan")},
        {"numbers": ["9" * 5000], "target": 3},  # int(): Python's digit limit
        {"numbers": 5, "target": 3},
        "null",
        {},
    ],
)
def test_malformed_countdown_specs_are_none(spec):
    assert parse_countdown(spec) is None


def test_countdown_spec_from_json_or_mapping():
    assert parse_countdown('{"numbers": [1, "2"], "target": 3}') == ([1, 2], 3)
    assert parse_countdown({"numbers": [4], "target": 4}) == ([4], 4)
