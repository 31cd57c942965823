"""verl 0.9.1's own reward path against a running reward service (verl installed from PyPI with
``--no-deps`` by deploy/setup.sh; ray, tensordict, omegaconf, codetiming from the dev extra).

- ``naive`` and ``remote``: ``verl/experimental/reward_loop/reward_loop.py``,
  ``RewardLoopManager.compute_rm_score`` (what ``verl/trainer/ppo/ray_trainer.py`` calls) on a local
  Ray instance, the custom reward function loaded by verl itself (``verl/trainer/ppo/reward.py``,
  ``get_custom_reward_fn``) from ``reward.custom_reward_function.path``. The ``remote`` manager
  (``reward_manager/remote.py``) runs the function in ``RewardComputeWorker`` Ray actors: it must
  pickle, import there and give every sample the same keys (verl stacks them into arrays).
- the batch adapter: ``verl/workers/reward_manager/batch.py``, ``BatchRewardManager`` (numpy object
  arrays for ``data_sources`` and ``extra_infos``).
Prompts and responses are token ids of the tiny model's tokenizer, decoded by verl.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.experimental.reward_loop import RewardLoopManager
from verl.workers.reward_manager import BatchRewardManager

import loom.clients.verl as loom_verl
from zoo.tiny import CHECKPOINT_DIR, load_tokenizer

COMPONENTS = [{"name": "accuracy"}, {"name": "length_kimi", "weight": 0.1}]
# (prompt, response, ground truth, data source): ground truths as verl's parquet rows hold them
ROWS: list[tuple[str, str, Any, str]] = [
    ("2+3=?", "so \\boxed{5}", "5", "gsm8k"),
    ("2+3=?", "it is \\boxed{6}", np.int64(5), "gsm8k"),
    ("half?", "\\boxed{1/2}", 0.5, "math"),
    ("make 12", "\\boxed{(1+2)*4}", {"numbers": np.array([1, 2, 4]), "target": np.int64(12)}, "countdown"),
    ("1?", "\\boxed{1}", float("nan"), "math"),  # a label no component can read: 0, the rest score
]


def _batch(rows: list[tuple[str, str, Any, str]]) -> DataProto:
    """A verl rollout batch: left-padded prompts, right-padded responses, one attention mask."""
    tok = load_tokenizer()
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p, *_ in rows]
    r_ids = [tok(r, add_special_tokens=False)["input_ids"] for _, r, *_ in rows]
    plen, rlen = max(map(len, p_ids)), max(map(len, r_ids))
    pad = tok.pad_token_id
    prompts = torch.tensor([[pad] * (plen - len(x)) + x for x in p_ids])
    responses = torch.tensor([x + [pad] * (rlen - len(x)) for x in r_ids])
    mask = torch.tensor(
        [
            [0] * (plen - len(p)) + [1] * len(p) + [1] * len(r) + [0] * (rlen - len(r))
            for p, r in zip(p_ids, r_ids, strict=True)
        ]
    )
    non_tensor = {
        "data_source": np.array([ds for *_, ds in rows], dtype=object),
        "reward_model": np.array(
            [{"ground_truth": gt, "style": "rule"} for _, _, gt, _ in rows], dtype=object
        ),
        "extra_info": np.array([{"index": i} for i in range(len(rows))], dtype=object),
        "uid": np.array([p for p, *_ in rows], dtype=object),
    }
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "attention_mask": mask},
        non_tensors=non_tensor,
    )


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


def _config(manager: str, url: str, path: str) -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": str(CHECKPOINT_DIR), "tokenizer_path": None}},
            "reward": {
                "num_workers": 1,
                "custom_reward_function": {
                    "path": path,
                    "name": "compute_score",
                    # reward kwargs reach every Ray worker (environment variables may not)
                    "reward_kwargs": {"loom_url": url, "loom_components": COMPONENTS},
                },
                "reward_manager": {"source": "register", "name": manager, "module": {"path": None}},
                "reward_model": {"enable": False, "enable_resource_pool": False},
            },
        }
    )


@pytest.mark.parametrize(
    "manager, path",
    [
        ("naive", "pkg://loom.clients.verl"),
        ("remote", "pkg://loom.clients.verl"),
        ("remote", loom_verl.__file__),
    ],
)
def test_reward_loop_manager_scores_through_loom(local_ray, reward_url, manager, path) -> None:
    out = RewardLoopManager(_config(manager, reward_url, path)).compute_rm_score(_batch(ROWS))
    # the reward sits on each response's last valid token (RewardManagerBase.assemble_rm_scores)
    scores = out.batch["rm_scores"]
    assert scores.sum(dim=1).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert (scores != 0).sum().item() == 3
    assert out.meta_info["reward_extra_keys"] == ["score", "accuracy", "length_kimi", "status_ok"]
    extra = out.non_tensor_batch
    assert extra["accuracy"].tolist() == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert extra["status_ok"].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    # the reward loop scores one sample per call: a group-relative component sees a group of one
    assert extra["length_kimi"].tolist() == [0.0] * 5


def test_batch_reward_manager_passes_numpy_arrays(reward_url) -> None:
    manager = BatchRewardManager(
        tokenizer=load_tokenizer(),
        num_examine=0,
        compute_score=loom_verl.compute_score_batch,
        loom_url=reward_url,
        loom_components=COMPONENTS,
    )
    data = _batch(ROWS)
    for info, (prompt, *_) in zip(data.non_tensor_batch["extra_info"], ROWS, strict=True):
        info["uid"] = prompt  # verl's prompt id: the two "2+3=?" samples are one group
    assert isinstance(data.non_tensor_batch["extra_info"], np.ndarray)
    out = manager(data, return_dict=True)
    info = out["reward_extra_info"]
    assert info["accuracy"] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert info["status_ok"] == [1.0, 1.0, 1.0, 1.0, 0.0]
    # in one group the correct sample gets the full Kimi length reward, the wrong one 0
    assert info["length_kimi"][:2] == [1.0, 0.0]
    assert out["reward_tensor"].sum(dim=1).tolist() == pytest.approx([1.1, 0.0, 1.0, 1.0, 0.0])
