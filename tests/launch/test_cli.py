"""``loom worker learner``'s ranks: ``--nproc`` over the LOOM_LEARNER_NPROC setting."""

from __future__ import annotations

import pytest

from launch.cli import learner_nproc
from loom.contracts.settings import Settings


def test_the_learner_ranks_come_from_nproc_else_from_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOOM_LEARNER_NPROC", "3")
    settings = Settings()
    assert settings.learner_nproc == 3
    assert learner_nproc(None, settings) == 3
    assert learner_nproc(2, settings) == 2
    monkeypatch.delenv("LOOM_LEARNER_NPROC")
    assert learner_nproc(None, Settings()) == 1
    monkeypatch.setenv("LOOM_LEARNER_NPROC", "0")
    with pytest.raises(ValueError):
        Settings()
