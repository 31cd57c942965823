"""TRL 1.16's own ``GRPOTrainer`` trains on Loom's rewards (trl from PyPI, the dev extra).

Two optimizer steps of the tiny model (zoo/tiny/checkpoint) on its arithmetic prompts, with
``reward_funcs=[make_reward_func(url, ...)]`` against a running reward service: TRL calls the function
with its dataset columns (``trl/trainer/grpo_trainer.py``, ``GRPOTrainer._calculate_rewards``), logs
the rewards it trains on, and the metrics the function logs through ``log_metric``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from loom.clients.trl import MissingLabelColumn, make_reward_func
from zoo.tiny import load_model, load_tokenizer, tiny_problems
from zoo.tiny.traces import plain_prompt

COMPONENTS = [{"name": "accuracy"}, {"name": "format_think", "weight": 0.5}]


def _dataset(label_column: str) -> Dataset:
    problems = tiny_problems("arith", 2, seed=0, split="train")
    # the gold as an int: datasets keep numbers as numbers (label_text coerces them)
    return Dataset.from_list([{"prompt": plain_prompt(p), label_column: int(p.gold)} for p in problems])


def _trainer(tmp_path: Any, reward_funcs: list[Any], dataset: Dataset) -> GRPOTrainer:
    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,  # one prompt's group of 4 per step
        max_completion_length=48,
        learning_rate=1e-4,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=load_model(),
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(),
    )


def test_grpo_trainer_trains_two_steps_on_loom_rewards(tmp_path, reward_url) -> None:
    loom_reward = make_reward_func(
        reward_url, components=COMPONENTS, task="arithmetic", label_column="solution"
    )
    returned: list[list[float | None]] = []

    def recorded(*args: Any, **kwargs: Any) -> list[float | None]:
        out = loom_reward(*args, **kwargs)
        returned.append(out)
        return out

    recorded.__name__ = loom_reward.__name__
    trainer = _trainer(tmp_path, [recorded], _dataset("solution"))
    trainer.train()

    steps = [h for h in trainer.state.log_history if "rewards/loom_reward/mean" in h]
    assert trainer.state.global_step == 2
    assert len(steps) == 2 and len(returned) == 2 and all(len(r) == 4 for r in returned)
    for logged, ours in zip(steps, returned, strict=True):
        assert all(v in (0.0, 0.5, 1.0, 1.5) for v in ours)  # accuracy + 0.5 * format_think
        # TRL's logged reward of the step is the mean of what Loom returned for it ...
        assert logged["rewards/loom_reward/mean"] == pytest.approx(sum(ours) / 4, abs=1e-6)
        # ... and the components Loom logged through TRL's log_metric add up to those totals
        acc = [float(v >= 1.0) for v in ours]
        fmt = [(v - a) / 0.5 for v, a in zip(ours, acc, strict=True)]
        assert logged["loom/accuracy"] == pytest.approx(sum(acc) / 4)
        assert logged["loom/format_think"] == pytest.approx(sum(fmt) / 4)
        assert 0.0 <= logged["loom/status_ok"] <= 1.0


def test_grpo_trainer_stops_when_the_label_column_is_missing(tmp_path, reward_url) -> None:
    # the default label column is "answer"; this dataset calls it "solution"
    trainer = _trainer(tmp_path, [make_reward_func(reward_url, task="arithmetic")], _dataset("solution"))
    with pytest.raises(MissingLabelColumn, match=r"no label column 'answer' \(its columns: \['solution'\]\)"):
        trainer.train()
