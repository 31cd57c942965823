"""Tempered log-probs: trajectories sampled at temperature T by the torch engine ('processed'
log-probs) are recomputed by the learner with ``LossSpec.temperature = T`` to the same numbers, and
behaviour log-probs of another policy (raw ones at T != 1) are not used for the ratio."""

from __future__ import annotations

import asyncio

import pytest
import torch

from learner import logprobs as lp
from learner.config import LearnerSettings
from learner.train import Learner
from loom.contracts.wire import (
    Group,
    LogprobsProcessing,
    LossSpec,
    RewardResult,
    SamplingParams,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
)
from rollout_svc.engines.torch import TorchEngine
from zoo.tiny import CHECKPOINT_DIR, make_problems, plain_prompt

T = 1.3


def _group(
    kind: str, processing: LogprobsProcessing | None = LogprobsProcessing(temperature=T)
) -> tuple[Group, RewardResult]:
    engine = TorchEngine(CHECKPOINT_DIR, logprobs_mode=kind, cache_entries=0)  # type: ignore[arg-type]
    tok = engine.tokenizer
    prob = make_problems("arith", 1, seed=3)[0]
    ids = tok.encode(plain_prompt(prob), add_special_tokens=False)
    outs = asyncio.run(engine.generate(ids, SamplingParams(n=4, max_tokens=24, temperature=T, seed=5)))
    trajs = [
        Trajectory(
            id=f"g-{i}",
            group_id="g",
            prompt_ids=ids,
            completion_ids=c.token_ids,
            logprobs=c.logprobs,
            logprobs_kind=kind,  # type: ignore[arg-type]
            logprobs_processing=processing if kind == "processed" else None,
        )
        for i, c in enumerate(outs)
    ]
    rewards = [TrajectoryReward(trajectory_id=t.id, total=float(i % 2)) for i, t in enumerate(trajs)]
    return Group(id="g", trajectories=trajs), RewardResult(group_id="g", rewards=rewards)


def test_recompute_at_the_sampling_temperature_equals_the_engines_processed_logprobs():
    group, _ = _group("processed")
    model = TorchEngine(CHECKPOINT_DIR, cache_entries=0).model
    with torch.no_grad():
        tempered = lp.recompute(model, group.trajectories, temperature=T)
        raw = lp.recompute(model, group.trajectories)
    for mb_t, mb_r in zip(tempered, raw, strict=True):
        for row, i in enumerate(mb_t.index):
            t = group.trajectories[i]
            n = len(t.completion_ids)
            got = mb_t.logp[row, :n]
            assert torch.allclose(got, torch.tensor(t.logprobs), atol=1e-4)
            assert not torch.allclose(mb_r.logp[row, :n], got, atol=1e-3)  # the scaling matters


@pytest.mark.parametrize(
    ("kind", "processing", "temperature", "used"),
    [
        ("processed", LogprobsProcessing(temperature=T), T, 1.0),
        ("raw", None, T, 0.0),
        ("raw", None, 1.0, 1.0),
        # processed at another temperature than the learner's
        ("processed", LogprobsProcessing(temperature=T), 1.0, 0.0),
        # top-p / top-k shape the processed log-probs; the learner applies neither
        ("processed", LogprobsProcessing(temperature=T, top_p=0.8), T, 0.0),
        ("processed", LogprobsProcessing(temperature=T, top_k=20), T, 0.0),
        # processed, but nobody said how: not trusted
        ("processed", None, T, 0.0),
    ],
)
def test_behaviour_logprobs_are_used_only_when_they_match_the_learners_processing(
    tmp_path, kind, processing, temperature, used
):
    group, result = _group(kind, processing)
    learner = Learner(LearnerSettings(model=CHECKPOINT_DIR, store=tmp_path / "store"))
    loss = LossSpec(temperature=temperature, lr=1e-5)
    out = learner.train_step(TrainBatch(step=0, groups=[group], rewards=[result], loss=loss))
    assert out.metrics["behaviour_logprobs_used"] == used
    assert out.metrics["behaviour_logprobs_unmatched"] == 1.0 - used  # every row carries log-probs
    if used:  # the same policy, recomputed: ratio 1 up to float error before the update
        assert out.metrics["logprob_mismatch_max"] < 1e-4


def test_several_updates_per_batch_move_the_policy_further(tmp_path):
    group, result = _group("processed")
    deltas = []
    for mu in (1, 3):
        learner = Learner(LearnerSettings(model=CHECKPOINT_DIR, store=tmp_path / f"store{mu}"))
        before = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        loss = LossSpec(temperature=T, lr=1e-4, updates_per_batch=mu)
        out = learner.train_step(TrainBatch(step=0, groups=[group], rewards=[result], loss=loss))
        after = learner.model.state_dict()
        deltas.append(sum(float((after[k] - before[k]).abs().sum()) for k in before))
        if mu > 1:
            assert out.metrics["updates"] == mu
            assert out.policy_version == 1  # one published version per batch
    assert deltas[1] > 1.5 * deltas[0]
