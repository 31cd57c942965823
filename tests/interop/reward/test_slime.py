"""slime's remote reward model against a running reward service, replayed from its source.

slime is not on PyPI. Replayed from THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515:
- the request: ``slime/rollout/rm_hub/__init__.py``, ``remote_rm`` (payload ``{"prompt": sample.prompt,
  "response": sample.response, "label": sample.label}`` through one shared ``aiohttp.ClientSession``
  with ``TCPConnector(limit=64)`` and ``ClientTimeout(total=120)``; ``raise_for_status()``; the reward
  is ``await resp.json()`` as it is);
- the reply: ``slime/utils/types.py``, ``Sample.get_reward_value`` (``self.reward if not
  args.reward_key else self.reward[args.reward_key]``), then ``slime/ray/rollout.py``,
  ``RolloutManager._post_process_rewards`` (GRPO group norm: ``torch.tensor(raw_rewards,
  dtype=torch.float)``), and ``slime/observability/rollout_metrics.py``, ``_compute_reward_cat_metrics``
  (``--log-reward-category``: ``group_by(samples, lambda s: s.reward[reward_cat_key])``).
``Sample.prompt`` is ``str | list[dict[str, str]]`` and ``Sample.label`` the dataset's value as read
(``slime/utils/data.py``: ``label=data[label_key]``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace
from typing import Any

import aiohttp
import torch


async def _remote_rm(rm_url: str, samples: list[dict[str, Any]]) -> list[Any]:
    connector = aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def one(sample: dict[str, Any]) -> Any:
            payload = {"prompt": sample["prompt"], "response": sample["response"], "label": sample["label"]}
            async with session.post(rm_url, json=payload) as resp:
                resp.raise_for_status()
                return await resp.json()

        return list(await asyncio.gather(*(one(s) for s in samples)))


def _get_reward_value(reward: Any, args: SimpleNamespace) -> Any:
    return reward if not args.reward_key else reward[args.reward_key]


def _group_norm(raw_rewards: list[Any], n_samples_per_prompt: int) -> list[float]:
    rewards = torch.tensor(raw_rewards, dtype=torch.float)
    rewards = rewards.reshape(-1, n_samples_per_prompt)
    rewards = rewards - rewards.mean(dim=-1, keepdim=True)
    return list(rewards.flatten().tolist())


CHAT = [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "2+3?"}]
SAMPLES = [
    # one prompt's group of 4: a chat prompt (Sample.prompt as a message list), labels as data holds them
    {"prompt": CHAT, "response": "It is \\boxed{5}", "label": 5},
    {"prompt": CHAT, "response": "It is \\boxed{6}", "label": 5},
    {"prompt": CHAT, "response": "It is \\boxed{5.0}", "label": 5.0},
    {"prompt": CHAT, "response": "no answer", "label": "5"},
]


def test_slime_defaults_get_a_number_it_can_train_on(reward_url: str) -> None:
    args = SimpleNamespace(reward_key=None)  # slime's default: no --reward-key
    replies = asyncio.run(_remote_rm(f"{reward_url}/v1/slime/reward", SAMPLES))
    raw = [_get_reward_value(r, args) for r in replies]
    assert raw == [1.0, 0.0, 1.0, 0.0]
    assert _group_norm(raw, n_samples_per_prompt=4) == [0.5, -0.5, 0.5, -0.5]


def test_reward_key_and_log_reward_category_read_the_components_route(reward_url: str) -> None:
    # --reward-key reward --log-reward-category status, with --rm-url .../v1/slime/reward/components
    args = SimpleNamespace(reward_key="reward", log_reward_category="status")
    replies = asyncio.run(_remote_rm(f"{reward_url}/v1/slime/reward/components", SAMPLES))
    raw = [_get_reward_value(r, args) for r in replies]
    assert raw == [1.0, 0.0, 1.0, 0.0]
    assert _group_norm(raw, n_samples_per_prompt=4) == [0.5, -0.5, 0.5, -0.5]
    cats = Counter(r[args.log_reward_category] for r in replies)
    assert cats == {"ok": 3, "no_answer": 1}
    assert [r["accuracy"] for r in replies] == [1.0, 0.0, 1.0, 0.0]  # a component is a valid key too


def test_unreadable_or_over_long_items_are_zero_not_errors(reward_url: str) -> None:
    samples = [
        {"prompt": "p", "response": "\\boxed{1}", "label": None},
        {"prompt": "p", "response": "\\boxed{1}", "label": True},
        {"prompt": "p", "response": "x" * 6000 + "\\boxed{1}", "label": 1},  # service max_chars 5000
        {"prompt": "p", "response": "\\boxed{1}", "label": 1},
    ]
    detail = asyncio.run(_remote_rm(f"{reward_url}/v1/slime/reward/components", samples))
    assert [d["status"] for d in detail] == ["invalid", "invalid", "invalid", "ok"]
    assert [d["reward"] for d in detail] == [0.0, 0.0, 0.0, 1.0]
    raw = asyncio.run(_remote_rm(f"{reward_url}/v1/slime/reward", samples))
    assert torch.tensor(raw, dtype=torch.float).tolist() == [0.0, 0.0, 0.0, 1.0]


def test_countdown_task_from_the_url(reward_url: str) -> None:
    samples = [
        {"prompt": "make 12", "response": "\\boxed{(1+2)*4}", "label": {"numbers": [1, 2, 4], "target": 12}}
    ]
    assert asyncio.run(_remote_rm(f"{reward_url}/v1/slime/reward?task=countdown", samples)) == [1.0]
