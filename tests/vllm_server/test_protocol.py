"""The real vLLM answers every request of tests/rollout/control_cases.py as that table says: the table
``loom engine`` is held to (tests/rollout/test_control.py) is vLLM's own behaviour, so the imitation
cannot drift from the server users run."""

from __future__ import annotations

from typing import Any

import httpx

from tests.rollout.control_cases import CASES, problems, send
from tests.vllm_server.conftest import SERVED


def test_vllm_answers_every_control_request_as_the_table_says(vllm: Any) -> None:
    url = vllm.ensure("raw")
    label = httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"]
    httpx.post(f"{url}/update_weight_version", json={"new_version": "default"}, timeout=10)
    found = {}
    # a fresh connection per request: vLLM closes the one a 500 came on (the vllm client copes)
    with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        try:
            for case in CASES:
                if diff := problems(send(client, case, SERVED), case, SERVED):
                    found[case.id] = diff
        finally:
            client.post("/update_weight_version", json={"new_version": label})
    assert not found, found


def test_vllm_reports_its_version_and_log_prob_mode(vllm: Any) -> None:
    url = vllm.ensure("raw")
    assert httpx.get(f"{url}/version", timeout=10).json() == {"version": "0.32.0"}
    info = httpx.get(f"{url}/server_info", params={"config_format": "json"}, timeout=60).json()
    assert info["vllm_config"]["model_config"]["logprobs_mode"] == "raw_logprobs"
