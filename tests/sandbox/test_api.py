"""The sandbox service over HTTP: Loom's shape, SandboxFusion's ``run_code`` driven by verl's own
client code (its installed package), admission as a typed 429."""

from __future__ import annotations

import threading

import httpx
import pytest

from loom.clients.sandbox import SandboxClient
from loom.contracts.sandbox import Limits, RunRequest


def test_run_and_batch_answer_typed_outcomes(sandbox_url: str) -> None:
    r = httpx.post(f"{sandbox_url}/v1/sandbox/run", json={"code": "print(input()[::-1])", "stdin": "abc\n"})
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["stdout"] == "cba\n"
    runs = [
        {"code": "print(1)"},
        {"code": "import os\nwhile True: os.fork()"},
        {"language": "bash", "code": "exit 4"},
    ]
    b = httpx.post(f"{sandbox_url}/v1/sandbox/batch", json={"runs": runs}, timeout=60).json()["results"]
    assert [x["status"] for x in b][0::2] == ["ok", "runtime_error"] and b[2]["exit_code"] == 4
    assert b[1]["status"] in ("runtime_error", "timeout")


def test_bad_requests_are_422_with_the_field(sandbox_url: str) -> None:
    r = httpx.post(f"{sandbox_url}/v1/sandbox/run", json={"code": "x", "language": "cobol"})
    assert r.status_code == 422 and r.json()["error"] == "validation_error"
    assert any("language" in str(p.get("loc")) for p in r.json()["detail"])


def test_health_reports_the_pool(sandbox_url: str) -> None:
    h = httpx.get(f"{sandbox_url}/v1/sandbox/health").json()
    assert h["slots"] == 2 and h["bwrap"] and h["capacity"] == 6
    assert httpx.get(f"{sandbox_url}/readyz").status_code in (200, 503)  # 503 only for the broker


def test_verl_sandbox_fusion_client_scores_through_loom(sandbox_url: str) -> None:
    from verl.utils.reward_score.sandbox_fusion import compute_score
    from verl.utils.reward_score.sandbox_fusion.utils import call_sandbox_api

    resp, err = call_sandbox_api(f"{sandbox_url}/run_code", "print(2 + 3)", None, 5, 5, 256, "python")
    assert err is None and resp["status"] == "Success" and resp["run_result"]["stdout"] == "5\n"
    tests = {"inputs": ["1 2\n", "5 7\n", "10 -3\n"], "outputs": ["3\n", "12\n", "7\n"]}
    right = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(a + b if a < 10 else 0)\n```"
    hang = "```python\nwhile True:\n    pass\n```"
    sem = threading.Semaphore(2)
    assert compute_score(f"{sandbox_url}/run_code", sem, 256, right, tests, timeout=5)[0] == 1.0
    score, meta = compute_score(f"{sandbox_url}/run_code", sem, 256, wrong, tests, timeout=5)
    assert score == pytest.approx(2 / 3)
    score, meta = compute_score(f"{sandbox_url}/run_code", sem, 256, hang, tests, timeout=1)
    assert score == 0.0 and {m["status"] for m in meta} == {"timeout"}


def test_run_code_refuses_what_loom_does_not_run(sandbox_url: str) -> None:
    r = httpx.post(f"{sandbox_url}/run_code", json={"code": "int main(){}", "language": "cpp"}).json()
    assert r["status"] == "SandboxError" and "cpp" in r["message"]


def test_a_full_sandbox_is_429_busy_and_the_client_waits_it_out(sandbox_url: str) -> None:
    slow = {"code": "import time\ntime.sleep(3)", "limits": {"wall_s": 10}}
    with httpx.Client(timeout=60) as http:
        holder = threading.Thread(
            target=lambda: http.post(f"{sandbox_url}/v1/sandbox/batch", json={"runs": [slow] * 6})
        )
        holder.start()
        try:
            for _ in range(100):
                if httpx.get(f"{sandbox_url}/v1/sandbox/health").json()["in_flight"] >= 6:
                    break
            r = httpx.post(f"{sandbox_url}/v1/sandbox/run", json={"code": "print(1)"})
            assert r.status_code == 429 and r.json()["error"] == "busy" and "Retry-After" in r.headers
            waited = SandboxClient(sandbox_url, busy_wait_s=60).run(
                RunRequest(code="print(7)", limits=Limits())
            )
            assert waited.status == "ok" and waited.stdout == "7\n"
        finally:
            holder.join(60)
    gone = SandboxClient("http://127.0.0.1:9", retries=0).run(RunRequest(code="print(1)"))
    assert gone.status == "sandbox_error" and "unreachable" in (gone.detail or "")
