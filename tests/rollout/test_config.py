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


def test_the_modes_bounds_keep_their_names_and_are_the_rollout_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway checks a submission against the modes' bounds: they live in the contracts'
    ``ModeSettings``, which the rollout role's settings extend; the shared settings hold none."""
    monkeypatch.setenv("LOOM_ROLLOUT_SEGMENT_CAP", "64")
    monkeypatch.setenv("LOOM_ROLLOUT_READING_WPM", "90")
    limits = ModeLimits.from_settings(Settings())
    assert (limits.segment_cap, limits.reading_wpm) == (64, 90.0)
    rollout = RolloutSettings()
    assert (rollout.segment_cap, rollout.reading_wpm) == (64, 90.0)
    assert not {"rollout_segment_cap", "rollout_reading_wpm"} & set(Settings.model_fields)


def test_the_shared_settings_hold_no_role_prefixed_field() -> None:
    """A role's knob lives in its role's settings; the shared ones name hosts' ports by role only."""
    roles = ("gateway_", "rollout_", "reward_", "reflect_", "learner_", "sandbox_", "vllm_")
    prefixed = [f for f in Settings.model_fields if f.startswith(roles) and not f.endswith("_port")]
    assert prefixed == []
