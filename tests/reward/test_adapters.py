"""The verl, TRL and OpenRLHF/slime adapters against a running ``uvicorn reward_svc.api:app``."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def service_url(tmp_path_factory):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(
        LOOM_DATA_DIR=str(tmp_path_factory.mktemp("reward-data")),
        LOOM_TORCH_THREADS="1",
        LOOM_REWARD_WORKERS="1",
    )
    log = tmp_path_factory.mktemp("log") / "uvicorn.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "reward_svc.api:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        else:
            raise RuntimeError(log.read_text())
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_verl_compute_score_and_batch(service_url, monkeypatch):
    import numpy as np

    from loom.clients import verl

    monkeypatch.setenv("LOOM_REWARD_URL", service_url)
    monkeypatch.setenv(
        "LOOM_REWARD_COMPONENTS", json.dumps([{"name": "accuracy"}, {"name": "length_kimi", "weight": 0.1}])
    )
    one = verl.compute_score("gsm8k", "so \\boxed{42}", "42")
    assert one["score"] == pytest.approx(1.0) and one["accuracy"] == 1.0 and one["status_ok"] == 1.0
    # verl's batch manager passes numpy object arrays; parquet rows hold numpy arrays inside labels
    out = verl.compute_score_batch(
        data_sources=np.array(["math", "math", "countdown"], dtype=object),
        solution_strs=["\\boxed{1/2}", "a longer wrong answer \\boxed{3}", "\\boxed{(1+2)*4}"],
        ground_truths=np.array(
            ["0.5", 0.5, {"numbers": np.array([1, 2, 4]), "target": np.int64(12)}], dtype=object
        ),
        extra_infos=np.array([{"uid": "p"}, {"uid": "p"}, {"uid": "q"}], dtype=object),
    )
    assert [o["accuracy"] for o in out] == [1.0, 0.0, 1.0]
    # uid "p" is one group: the shorter correct sample gets the full Kimi length reward
    assert out[0]["length_kimi"] == 1.0 and out[1]["length_kimi"] == 0.0
    # every sample has the same keys (verl stacks them into arrays), an unreadable label too
    odd = verl.compute_score_batch(["math"] * 2, ["\\boxed{1}"] * 2, [float("nan"), 1], None)
    assert [o["score"] for o in odd] == [0.0, pytest.approx(1.0)]
    assert odd[0].keys() == odd[1].keys() == out[0].keys()


def test_trl_reward_function(service_url):
    from loom.clients.trl import make_reward_func

    f = make_reward_func(
        service_url, components=[{"name": "accuracy"}, {"name": "format_think"}], label_column="solution"
    )
    prompts = ["What is 6*7?"] * 2 + [[{"role": "user", "content": "1+1?"}]]
    completions = [
        "<think>6*7</think> \\boxed{42}",
        "\\boxed{41}",
        [{"role": "assistant", "content": "<think>x</think>\\boxed{2}"}],
    ]
    assert f(prompts, completions, solution=["42", "42", "2"]) == [2.0, 0.0, 2.0]
    acc = make_reward_func(
        service_url,
        components=[{"name": "accuracy"}, {"name": "format_think"}],
        component="accuracy",
        label_column="solution",
    )
    logged: dict[str, float] = {}
    assert acc(prompts, completions, solution=[42, 42, 2], log_metric=logged.__setitem__) == [1.0, 0.0, 1.0]
    assert logged == {
        "loom/accuracy": pytest.approx(2 / 3),
        "loom/format_think": pytest.approx(2 / 3),
        "loom/status_ok": 1.0,
    }


def test_trl_reward_function_without_its_label_column_fails_naming_the_columns(service_url):
    from loom.clients.trl import MissingLabelColumn, make_reward_func

    f = make_reward_func(service_url)  # label_column="answer"
    with pytest.raises(MissingLabelColumn, match=r"'answer'.*\['solution'\]"):
        f(["q"], ["\\boxed{1}"], solution=["1"], trainer_state=None, log_metric=print)
    fmt = make_reward_func(service_url, components=[{"name": "format_think"}], label_column=None)
    assert fmt(["q"], ["<think>a</think> \\boxed{b}"], solution=["1"]) == [1.0]


def test_openrlhf_and_slime_clients(service_url):
    from loom.clients.reward import RewardClient

    with RewardClient(service_url) as c:
        r = c.openrlhf(["Q: \\boxed{7}", "Q: 8"], ["Q:", "Q:"], ["7", "7"])
        assert r["rewards"] == [1.0, 0.0]
        assert c.slime("p", "\\boxed{7}", "7") == 1.0
        assert c.slime_components([{"role": "user", "content": "p"}], "\\boxed{7}", 7)["reward"] == 1.0


def test_client_retries_then_raises_on_a_dead_service():
    from loom.clients.reward import RewardClient

    with RewardClient(f"http://127.0.0.1:{free_port()}", retries=1, timeout=2) as c:
        with pytest.raises(httpx.TransportError):
            c.slime("p", "x", "1")
