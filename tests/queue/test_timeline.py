"""loom/timeline.py: marks go to LOOM_TIMELINE's file as JSON lines, and nowhere without it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loom import timeline


def test_marks_are_appended_as_lines_and_read_back_in_time_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setattr(timeline, "PATH", str(path))
    threads = [
        threading.Thread(target=lambda i=i: [timeline.mark("ev", f"k{i}", n=j) for j in range(50)])
        for i in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    marks = timeline.read(path)
    assert len(marks) == 200
    assert sorted((m["key"], m["n"]) for m in marks) == sorted(
        (f"k{i}", j) for i in range(4) for j in range(50)
    )
    assert [m["t"] for m in marks] == sorted(m["t"] for m in marks)
    assert {m["event"] for m in marks} == {"ev"}


def test_without_the_variable_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeline, "PATH", None)
    monkeypatch.chdir(tmp_path)
    timeline.mark("ev", "k")
    assert list(tmp_path.iterdir()) == []
    assert timeline.read(tmp_path / "absent.jsonl") == []
