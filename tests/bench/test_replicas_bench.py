"""bench/replicas.py at a tiny size (4 replicas, 2 keys) on the real gateway, RabbitMQ and Redis: its
report's fields are there and add up (not its times)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_replicas", ROOT / "bench" / "replicas.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_jains_index_is_one_for_equal_shares_and_one_over_n_for_one_key_alone() -> None:
    jain = bench().jain
    assert jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain([5.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain([1.0, 2.0]) == pytest.approx(9 / 10)  # (1 + 2)^2 / (2 (1 + 4))
    assert jain([0.0, 0.0]) == 0.0


@pytest.mark.slow
def test_tiny_run_reports_every_field_and_the_counts_add_up(tmp_path: Path) -> None:
    reachable = bench().reachable
    if not (reachable(5672) and reachable(6379)):
        pytest.skip("bench/replicas.py needs RabbitMQ on 127.0.0.1:5672 and Redis on 127.0.0.1:6379")
    out = tmp_path / "phases.json"
    cmd = [sys.executable, "bench/replicas.py", "--workers", "2", "--slots", "2", "--keys", "2"]
    cmd += ["--jobs", "1", "--prompts", "4", "--phases", "pipeline", "--warmup", "1", "--seconds", "6"]
    cmd += ["--group-ms", "400", "--slow-tokens", "8", "--fast-tokens", "4", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    assert "replicas: 4 (2 rollout worker processes x 2 engine slots" in text
    for field in (
        "groups/s",
        "queue depth",
        "per-key groups/s: k00=",
        "Jain's fairness index",
        "first bottleneck:",
    ):
        assert field in text, text
    (ph,) = json.loads(out.read_text())
    assert ph["name"] == "pipeline" and ph["max_tokens"] == 4
    assert ph["group_s"] == pytest.approx(0.2)  # 400 ms for 8 tokens: 4 tokens take 0.2 s
    assert len(ph["per_key"]) == 2 and sum(ph["per_key"]) == ph["groups"] > 0
    assert all(x > 0 for x in ph["per_key"])  # both keys got groups through
    assert ph["jobs_failed"] == 0
    assert ph["requests"] >= 2  # the keys polled their jobs in the window (one poll a second each)
    assert ph["groups_per_s"] == pytest.approx(ph["groups"] / ph["seconds"])
    assert ph["capacity_per_s"] == pytest.approx(4 / ph["group_s"])
    assert ph["utilization"] == pytest.approx(ph["groups_per_s"] / ph["capacity_per_s"])
    assert ph["jain"] == pytest.approx(bench().jain([float(x) for x in ph["per_key"]]))
    assert 0.5 <= ph["jain"] <= 1.0  # two keys: 1/n at worst
    shares = [x / ph["groups"] for x in ph["per_key"]]
    assert ph["share_vs_weight"] == pytest.approx([s / 0.5 for s in shares])
    # every process was measured, the gateway and the rollout workers among them
    assert {"gateway", "rollout0", "rollout1", "engine0", "reward", "machine"} <= set(ph["cpu_s"])
    assert ph["cpu_s"]["gateway"] > 0 and ph["redis_commands"] > 0
    # the samples: one a second, counts that never go down and end at least at the window's
    samples = ph["samples"]
    assert len(samples) >= ph["seconds"] - 1
    for a, b in zip(samples, samples[1:], strict=False):
        assert b["t"] > a["t"] and all(y >= x for x, y in zip(a["done"], b["done"], strict=True))
    assert all(isinstance(s["rollout"], int) for s in samples)
    assert sum(samples[-1]["done"]) >= ph["groups"]
    assert ph["bottleneck"] and ph["bottleneck"] in text
