"""OpenRLHF 0.11.2's own reward client against a running reward service.

The request is OpenRLHF's code, installed from PyPI (``openrlhf==0.11.2 --no-deps``, deploy/setup.sh):
``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor._fetch_rewards_via_http`` (payload
``{"query", "prompts", "labels"}``, aiohttp, 180 s timeout, 5 tries). What OpenRLHF does with the reply
sits inline in methods that need vLLM and Ray, so it is replayed line for line from the same release:
``SingleTurnAgentExecutor.execute`` (``rewards_info_list[0]``; ``scores`` falling back to ``rewards``;
``extra_logs``) and ``openrlhf/trainer/ppo_utils/samples_generator.py``,
``SamplesGenerator._process_response_into_experience`` (``torch.tensor([reward_val])`` and
``torch.tensor([value])`` per extra log).
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from openrlhf.utils import agent  # openrlhf==0.11.2, installed by deploy/setup.sh


def _fetch(url: str, queries: list[str], prompts: list[str], labels: list[Any]) -> list[dict[str, Any]]:
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=[f"{url}/get_reward"])
    return asyncio.run(executor._fetch_rewards_via_http(queries, prompts, labels))


def _experience_info(rewards_info: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``execute``'s reply handling, then ``_process_response_into_experience``'s tensors."""
    score_value = rewards_info.get("scores")
    if score_value is None:
        score_value = rewards_info.get("rewards")
    reward_val, extra_logs = rewards_info.get("rewards"), rewards_info.get("extra_logs") or {}
    info = {"reward": torch.tensor([reward_val]), "score": torch.tensor([score_value])}
    for key, value in extra_logs.items():
        info[key] = torch.tensor([value])
    return info


def test_numeric_and_empty_labels_score_in_one_batch(reward_url: str) -> None:
    # OpenRLHF passes the dataset's label through untouched (openrlhf/datasets/prompts_dataset.py
    # ``preprocess_data``): a string, a number, or "" when no --label_key is set
    prompt = "Q: what is 2+3? A:"
    answers = ["\\boxed{5}", "\\boxed{5}", "\\boxed{5.0}", "\\boxed{5}", "\\boxed{6}"]
    labels: list[Any] = ["5", 5, 5.0, "", 5]
    (reply,) = _fetch(reward_url, [prompt + " " + a for a in answers], [prompt] * 5, labels)
    assert reply["rewards"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert reply["extra_logs"]["status_ok"] == [1.0, 1.0, 1.0, 0.0, 1.0]  # "": invalid, no label
    info = _experience_info(reply)
    assert info["reward"].shape == (1, 5) and info["reward"].sum().item() == 3.0
    assert info["accuracy"].tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]]


def test_a_countdown_dict_label_scores_with_the_task_in_the_url(reward_url: str) -> None:
    # OpenRLHF's payload has no task: --reward.remote_url carries it (?task=countdown)
    label = {"numbers": [1, 2, 4], "target": 12}
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=[f"{reward_url}/get_reward?task=countdown"])
    queries = ["make 12: \\boxed{(1+2)*4}", "make 12: \\boxed{1+2+4}"]
    (reply,) = asyncio.run(executor._fetch_rewards_via_http(queries, ["make 12:"] * 2, [label] * 2))
    assert reply["rewards"] == [1.0, 0.0] and reply["extra_logs"]["status_ok"] == [1.0, 1.0]


def test_one_sample_per_request_as_openrlhf_sends_it(reward_url: str) -> None:
    # ``execute`` sends [query], [prompt], [label] for each rollout: the reply's lists have one entry
    (reply,) = _fetch(reward_url, ["Q: 2+3? A: \\boxed{5}"], ["Q: 2+3? A:"], [5])
    info = _experience_info(reply)
    assert info["reward"].tolist() == [[1.0]] and info["score"].tolist() == [[1.0]]
    assert info["status_ok"].tolist() == [[1.0]]


def test_an_over_long_response_is_its_own_status_not_a_failed_request(reward_url: str) -> None:
    long = "Q: A:" + "x" * 6000 + " \\boxed{5}"  # the test service's LOOM_REWARD_MAX_CHARS is 5000
    (reply,) = _fetch(reward_url, [long, "Q: A: \\boxed{5}"], ["Q: A:", "Q: A:"], [5, 5])
    assert reply["rewards"] == [0.0, 1.0]
    assert reply["extra_logs"]["status_ok"] == [0.0, 1.0]


def test_unreadable_labels_score_zero_and_the_rest_still_score(reward_url: str) -> None:
    (reply,) = _fetch(reward_url, ["A: \\boxed{1}"] * 3, ["A:"] * 3, [True, None, 1])
    assert reply["rewards"] == [0.0, 0.0, 1.0]
    assert reply["extra_logs"]["status_ok"] == [0.0, 0.0, 1.0]
