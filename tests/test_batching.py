"""AttnRL eq. 10, the one rule the gateway (next step's batch) and the learner (its metric) use."""

from __future__ import annotations

import pytest

from loom.batching import next_batch_size


def test_adaptive_batch_size_follows_attnrl_eq10() -> None:
    # B_{m+1} = round(0.9*16 + 0.1*(12/6)*16) = round(14.4 + 3.2) = 18
    assert next_batch_size(16, 12, 6) == 18
    assert next_batch_size(16, 12, 12) == 16
    assert next_batch_size(16, 12, 0, maximum=20) == 20  # none obtained: largest growth, clamped


def test_adaptive_batch_size_eq10() -> None:
    # B_m = 16, half the groups valid, target 16: round(.9*16 + .1*2*16) = round(17.6)
    assert next_batch_size(16, 16, 8) == 18
    assert next_batch_size(16, 16, 16) == 16
    assert next_batch_size(16, 16, 0) == round(0.9 * 16 + 0.1 * 16 * 16)
    assert next_batch_size(16, 16, 32, maximum=100) == round(0.9 * 16 + 0.1 * 0.5 * 16)
    assert next_batch_size(16, 16, 1, maximum=20) == 20


def test_adaptive_batch_size_clamps_to_the_minimum_and_refuses_empty_sizes() -> None:
    assert next_batch_size(16, 1, 16, minimum=15) == 15  # round(14.4 + 0.1) = 14, raised to 15
    assert next_batch_size(2, 1, 8, minimum=3) == 3
    with pytest.raises(ValueError):
        next_batch_size(0, 4, 1)
    with pytest.raises(ValueError):
        next_batch_size(4, 0, 1)
