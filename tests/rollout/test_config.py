"""The rollout service's own configuration (``RolloutSettings``, issue 36): ``LOOM_ROLLOUT_GROUP_TIMEOUT_S``
keeps its name, and the rollout values other processes read stay shared."""

from __future__ import annotations

import pytest

from loom.contracts.modes import ModeLimits
from loom.contracts.settings import Settings
from rollout_svc.config import GROUP_TIMEOUT_S, RolloutSettings


def test_the_group_timeout_is_read_by_its_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RolloutSettings().group_timeout_s == GROUP_TIMEOUT_S == 600.0
    monkeypatch.setenv("LOOM_ROLLOUT_GROUP_TIMEOUT_S", "2.5")
    assert RolloutSettings().group_timeout_s == 2.5
    monkeypatch.setenv("LOOM_ROLLOUT_GROUP_TIMEOUT_S", "0")
    with pytest.raises(ValueError, match="greater than 0"):
        RolloutSettings()


def test_the_modes_bounds_stay_shared_with_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway checks a submission against the modes' bounds: they are shared settings."""
    monkeypatch.setenv("LOOM_ROLLOUT_SEGMENT_CAP", "64")
    monkeypatch.setenv("LOOM_ROLLOUT_READING_WPM", "90")
    limits = ModeLimits.from_settings(Settings())
    assert (limits.segment_cap, limits.reading_wpm) == (64, 90.0)
