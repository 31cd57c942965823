"""The train step on Loom's shipped tiny checkpoint: a version engines can load, and a step that moves
probability towards the rewarded completion."""

from __future__ import annotations

import pytest
import torch

from learner import logprobs as lp
from learner.config import LearnerSettings
from learner.train import Learner
from loom.contracts.wire import Group, LossSpec, RewardResult, TrainBatch, Trajectory, TrajectoryReward

tiny = pytest.importorskip("zoo.tiny")
if not (tiny.CHECKPOINT_DIR / "config.json").exists():
    pytest.skip("the tiny checkpoint is not built", allow_module_level=True)


def _group(tok):
    prompt = tok.encode("[plain] What is 3 + 4?\n", add_special_tokens=False)
    texts = ["3 + 4 = 7. \\boxed{7}", "3 + 4 = 8. \\boxed{8}", "3 + 4 = 7. \\boxed{7}", "\\boxed{5}"]
    trajs = [
        Trajectory(
            id=f"t{i}",
            group_id="q",
            prompt_ids=prompt,
            completion_ids=tok.encode(t, add_special_tokens=False),
        )
        for i, t in enumerate(texts)
    ]
    rewards = [TrajectoryReward(trajectory_id=f"t{i}", total=float("7" in t)) for i, t in enumerate(texts)]
    return Group(id="q", trajectories=trajs), RewardResult(group_id="q", rewards=rewards)


def test_tiny_checkpoint_train_step_publishes_a_loadable_version_and_learns(tmp_path):
    tok = tiny.load_tokenizer()
    group, rewards = _group(tok)
    learner = Learner(LearnerSettings(model="tiny", store=tmp_path / "store"))

    def seq_logp():
        with torch.no_grad():
            (mb,) = lp.recompute(learner.model, group.trajectories)
            order = sorted(range(len(mb.index)), key=lambda r: mb.index[r])
            return (mb.logp * mb.valid).sum(1)[order]

    before = seq_logp()
    for step in range(3):
        res = learner.train_step(
            TrainBatch(step=step, groups=[group], rewards=[rewards], loss=LossSpec(lr=1e-3))
        )
    after = seq_logp()
    assert res.policy_version == 3 and res.policy is not None
    gain = after - before
    assert gain[0] > 0 and gain[2] > 0  # rewarded completions more likely
    # ... and more so than the unrewarded ones (which share their prefix tokens)
    assert min(gain[0], gain[2]) > max(gain[1], gain[3])
    # what an engine does: load model and tokenizer from the version directory
    model = tiny.load_model(res.policy.path)
    trained = learner.model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    assert tiny.load_tokenizer(res.policy.path).encode("3 + 4") == tok.encode("3 + 4")
