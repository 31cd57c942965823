"""``loom demo --task code`` (launch/demo.py): the embedded stack it starts runs the sandbox beside
the other services, and a few steps of the code model on the built-in code tasks are scored by the
code reward, with its statuses, from programs the sandbox ran."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from launch.demo import CODE_REWARD, main, parse_args, run_request
from loom.contracts.settings import SERVICES, get_settings
from sandbox_svc.runner import bwrap_path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_the_code_task_asks_for_the_code_dataset_and_reward() -> None:
    args = parse_args(["--task", "code"])
    body = run_request(args)
    assert body["dataset"]["builtin"] == "code" and body["reward"]["components"] == CODE_REWARD
    assert (args.batch_size, args.group_size) == (8, 8)
    with pytest.raises(SystemExit):
        parse_args(["--task", "code", "--mode", "spawn"])


@pytest.mark.slow
def test_a_few_code_demo_steps_are_scored_by_the_sandboxed_code_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if bwrap_path() is None:
        pytest.skip("bubblewrap is not installed (deploy/setup.sh)")
    for name in (*SERVICES, "engine"):  # a stack of its own beside whatever else runs here
        monkeypatch.setenv(f"LOOM_{name.upper()}_PORT", str(_free_port()))
    monkeypatch.delenv("LOOM_MODEL", raising=False)
    get_settings.cache_clear()
    argv = ["--task", "code", "--steps", "2", "--batch-size", "2", "--group-size", "4"]
    rc = main([*argv, "--time-limit", "400", "--out", str(tmp_path)])
    get_settings.cache_clear()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rc == 0 and [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert 0.0 <= row["reward/code_pass"] <= 1.0 and "reward/accuracy" in row
        statuses = {k: v for k, v in row.items() if k.startswith("status/")}
        assert abs(sum(statuses.values()) - 1.0) < 1e-9 and "status/sandbox_error" not in statuses
        assert statuses.get("status/ok", 0.0) > 0  # fenced programs the sandbox ran: the code model's
