"""``loom worker learner``'s ranks: ``--nproc`` over the LOOM_LEARNER_NPROC setting (learner/config.py)."""

from __future__ import annotations

import pytest

from launch.cli import learner_nproc
from learner.config import LearnerSettings


def test_the_learner_ranks_come_from_nproc_else_from_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_LEARNER_NPROC", "3")
    assert LearnerSettings().nproc == 3
    assert learner_nproc(None) == 3
    assert learner_nproc(2) == 2
    monkeypatch.delenv("LOOM_LEARNER_NPROC")
    assert learner_nproc(None) == 1
    monkeypatch.setenv("LOOM_LEARNER_NPROC", "0")
    with pytest.raises(ValueError):
        LearnerSettings()
