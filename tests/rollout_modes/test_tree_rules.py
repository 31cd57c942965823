"""Pure pieces of tree mode: step segmentation, branch-point strategies, difficulty-aware expansion."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rollout_svc.modes.tree import (
    attention_branch_points,
    attention_ranked,
    entropy_branch_points,
    entropy_mask,
    entropy_ranked,
    expanded_trees,
    quantile,
    random_branch_points,
    spaced_points,
    split_steps,
    zero_from_step,
)


def test_steps_split_after_blank_line_even_across_tokens():
    texts = ["a", " b", "\n", "\n", "c", "d\n\n", "e", "\n", "f"]
    # "\n" + "\n" completes at token 3; "d\n\n" at token 5; the lone "\n" at 7 is no boundary
    assert split_steps(texts) == [(0, 4), (4, 6), (6, 9)]


def test_steps_fall_back_to_newline_and_cover_everything():
    texts = ["x", "=", "1", "\n", "y", "\n", "z"]
    assert split_steps(texts) == [(0, 4), (4, 6), (6, 7)]
    assert split_steps(["no", " breaks"]) == [(0, 2)]
    assert split_steps([]) == []


def test_one_blank_line_falls_back_to_lines_but_two_do_not():
    # one paragraph of reasoning, a blank line, the answer: no interior step, so lines are steps
    texts = ["a", "\n", "b", "\n", "c", "\n\n", "d"]
    assert split_steps(texts) == [(0, 2), (2, 4), (4, 6), (6, 7)]
    # two blank lines give an interior step: the lone "\n" inside a paragraph is no boundary
    texts = ["a", "\n", "b", "\n\n", "c", "\n\n", "d"]
    assert split_steps(texts) == [(0, 4), (4, 6), (6, 7)]
    # blank lines after the end of thinking (token 4 here) do not count as interior steps
    assert split_steps(texts, end_token=4) == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_quantile_is_linear_interpolation():
    xs = [0.3, 0.1, 0.9, 0.5, 0.7, 0.2]
    assert quantile(xs, 0.8) == pytest.approx(float(torch.quantile(torch.tensor(xs), 0.8)))


def test_attention_candidates_take_n_earliest_above_quantile_at_min_distance():
    steps = [(0, 5), (5, 10), (10, 20), (20, 30), (30, 40), (40, 50), (50, 60), (60, 70), (70, 80), (80, 90)]
    fci = [0.0, 0.9, 0.2, 0.8, 0.85, 0.1, 0.95, 0.3, 0.0, 0.0]
    # step 0 starts at offset 0 (never a branch); eligible = scores > 0 at steps 1..7;
    # 0.8-quantile of [0.9, 0.2, 0.8, 0.85, 0.1, 0.95, 0.3] = 0.89: candidates steps 1 and 6
    assert attention_branch_points(fci, steps, n=2, q=0.8, min_distance=0) == [5, 50]
    assert attention_branch_points(fci, steps, n=1, q=0.8, min_distance=0) == [5]  # earliest first
    # lower quantile: candidates 1, 3, 4, 6 -> N earliest at >= 20 tokens apart: 5, 30 (20 is 15 away)
    assert attention_branch_points(fci, steps, n=2, q=0.5, min_distance=20) == [5, 30]
    assert attention_branch_points([0.0] * 10, steps, n=2) == []  # everything zeroed: no branching


def test_only_the_steps_after_the_end_of_thinking_marker_are_zeroed():
    # R1-style: the last thought ends "...\n</think>\n\n", so the marker sits inside the last thinking
    # paragraph; that step stays eligible, the answer steps after it score 0
    texts = ["<think>", " a", "\n\n", "b", "\n\n", "c", "\n", "</think>", "\n\n", "Final", "\n\n", "x"]
    end = texts.index("</think>")
    steps = split_steps(texts, end_token=end)
    assert steps == [(0, 3), (3, 5), (5, 9), (9, 11), (11, 12)]
    assert zero_from_step(steps, end) == 4  # 1-based (step 0 = the prompt): steps (9, 11) and (11, 12)
    # a step that begins with the marker is after it: zeroed
    texts2 = ["<think>", " a", "\n\n", "b", "\n\n", "</think>", "\n\n", "x"]
    steps2 = split_steps(texts2, end_token=5)
    assert steps2 == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert zero_from_step(steps2, 5) == 3
    assert zero_from_step(steps, None) is None
    assert zero_from_step(steps, 11) == 5  # the marker inside the last step: nothing after it
    # the random baseline follows the same rule: steps (3, 5) and (5, 9) only
    for seed in range(10):
        pts = random_branch_points(steps, 2, random.Random(seed), zero_from=zero_from_step(steps, end))
        assert pts == [3, 5]


def test_entropy_masks_first_token_and_everything_from_answer_on():
    texts = ["<think>", " 1", "+1", "=2", "\n", "The ", "Ans", "wer", " is", " 2"]
    mask = entropy_mask(texts)
    assert mask == [False, True, True, True, True, True, False, False, False, False]
    assert entropy_mask(["a", "b", "In conclusion", "c"]) == [False, True, False, False]


def test_entropy_picks_highest_negative_logprob_among_eligible():
    lps = [-9.0, -0.1, -3.0, -0.2, -5.0, -4.0, -8.0]
    ok = [False, True, True, True, True, True, False]
    assert entropy_branch_points(lps, ok, n=2) == [4, 5]
    assert entropy_branch_points(lps, ok, n=2, min_distance=2) == [2, 4]


def test_random_points_are_distinct_step_starts_never_the_first_step():
    steps = [(0, 3), (3, 9), (9, 12), (12, 20), (20, 25)]
    for seed in range(20):
        pts = random_branch_points(steps, 2, random.Random(seed), min_distance=0, zero_from=5)
        assert len(pts) == 2 and set(pts) <= {3, 9, 12} and pts == sorted(pts)


@pytest.mark.parametrize(
    ("correct", "rule", "want"),
    [
        ([0.0] * 6, "round", 6),
        ([1, 1, 1, 0, 0, 0], "round", round(math.exp(-0.5) * 6)),  # 3.64 -> 4
        ([1.0] * 6, "round", 2),  # exp(-1) * 6 = 2.2
        ([1.0] * 6, "ceil", 3),  # authors' ceil(exp(-i/n) n)
        ([1, 1, 1, 1, 1, 0], "ceil", math.ceil(math.exp(-5 / 6) * 6)),
        (None, "round", 6),
        ([1.0] * 6, "all", 6),
    ],
)
def test_difficulty_aware_expansion(correct, rule, want):
    assert expanded_trees(6, correct, rule) == (want, False)


def test_attention_filter_drops_only_all_correct_prompts_below_running_mean():
    assert expanded_trees(6, [1.0] * 6, "round", mean_fci=0.1, running_mean=0.2) == (0, True)
    assert expanded_trees(6, [1.0] * 6, "round", mean_fci=0.3, running_mean=0.2) == (2, False)
    assert expanded_trees(6, [1, 0, 1, 1, 1, 1], "round", mean_fci=0.1, running_mean=0.2)[1] is False


def test_pooled_rules_rank_across_paths_and_space_per_path():
    """Later expansion rounds pool several paths of a tree: ranks run across paths, spacing within one."""
    scored = [("a", 0.9, 30), ("b", 0.95, 10), ("a", 0.1, 12), ("b", 0.92, 40)]
    assert attention_ranked(scored, q=0.3) == [("b", 10), ("a", 30), ("b", 40)]  # earliest first
    assert attention_ranked(scored, q=0.5) == [("b", 10), ("b", 40)]  # threshold 0.91
    assert entropy_ranked([("a", -0.5, 3), ("b", -2.0, 9), ("a", -2.0, 7)]) == [("b", 9), ("a", 7), ("a", 3)]
    ranked = [("a", 20), ("b", 21), ("a", 25), ("b", 40), ("a", 60)]
    # "a" already has a point at 18: 20 and 25 are too close at distance 8; "b" keeps its own spacing
    assert spaced_points(ranked, 3, 8, {"a": [18]}) == [("b", 21), ("b", 40), ("a", 60)]
    assert spaced_points(ranked, 2, 0) == [("a", 20), ("b", 21)]
