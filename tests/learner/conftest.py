"""Learner fixtures: a REAL small random-weight HF Llama saved as a model directory, and batches."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loom.contracts.wire import Group, RewardResult, Segment, Trajectory, TrajectoryReward
from loom.runtime import configure_process

VOCAB = 64


def build_random_llama(path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configure_process()
    return build_random_llama(tmp_path_factory.mktemp("llama") / "base")


def make_batch_parts(
    n_groups: int = 2, g: int = 4, seed: int = 0, streaming: bool = True, behaviour: float | None = -4.0
) -> tuple[list[Group], list[RewardResult]]:
    """Groups of ``g`` trajectories with stream/observation/deep segments and HRPO-style components."""
    rnd = random.Random(seed)
    groups, results = [], []
    for gi in range(n_groups):
        trajs, rewards = [], []
        for i in range(g):
            n = rnd.randint(8, 20)
            ids = [rnd.randrange(VOCAB) for _ in range(n)]
            segs = []
            if streaming:
                segs = [
                    Segment(kind="stream", start=0, end=3),
                    Segment(kind="observation", start=3, end=5),
                    Segment(kind="stream", start=5, end=7),
                    Segment(kind="deep", start=7, end=n),
                ]
            tid = f"g{gi}-t{i}"
            trajs.append(
                Trajectory(
                    id=tid,
                    group_id=f"g{gi}",
                    prompt_ids=[1, 2, 3, 4],
                    completion_ids=ids,
                    logprobs=None if behaviour is None else [behaviour] * n,
                    loss_mask=[0 if 3 <= j < 5 and streaming else 1 for j in range(n)],
                    segments=segs,
                )
            )
            acc = float((i + gi) % 2)
            rewards.append(
                TrajectoryReward(
                    trajectory_id=tid,
                    total=acc,
                    components={
                        "accuracy": acc,
                        "format_stream": float(i != 2),
                        "format_deep": 1.0,
                        "length_stream": -float(i + 1),
                        "length_deep": -float(n % 3),
                        "efficiency": 0.1 * i * acc,
                    },
                )
            )
        groups.append(Group(id=f"g{gi}", mode="streaming", trajectories=trajs))
        results.append(RewardResult(group_id=f"g{gi}", rewards=rewards))
    return groups, results


@pytest.fixture
def batch_parts():  # type: ignore[no-untyped-def]
    """The ``make_batch_parts`` builder (tests import nothing from conftest)."""
    return make_batch_parts
