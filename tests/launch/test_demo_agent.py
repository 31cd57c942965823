"""``loom demo --mode agent`` (launch/demo.py): the embedded stack it starts serves the built-in tool
model, and two RL steps of agent mode (multi-turn: the policy's calls, the calculator's results) are
generated, scored and trained through the gateway's runs API."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from launch.demo import main
from loom.contracts.settings import SERVICES, get_settings


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.slow
def test_two_agent_demo_steps_train_the_tool_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*SERVICES, "engine"):  # a stack of its own beside whatever else runs here
        monkeypatch.setenv(f"LOOM_{name.upper()}_PORT", str(_free_port()))
    monkeypatch.delenv("LOOM_MODEL", raising=False)
    get_settings.cache_clear()
    argv = ["--mode", "agent", "--steps", "2", "--batch-size", "4", "--group-size", "4"]
    rc = main([*argv, "--time-limit", "400", "--out", str(tmp_path)])
    get_settings.cache_clear()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rc == 0 and [r["step"] for r in rows] == [0, 1]
    assert json.loads((tmp_path / "run_request.json").read_text())["mode_params"]["tools"] == ["calculator"]
    for row in rows:
        assert 0.0 <= row["reward/accuracy"] <= 1.0 and row["learner/samples"] > 0
    # the tool model answers part of its problems right: the episodes' calls ran the calculator
    assert sum(r["reward/accuracy"] for r in rows) > 0
    assert rows[-1]["policy_version"] >= 1
