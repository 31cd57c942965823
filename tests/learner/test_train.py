"""The train step on a real random-weight Llama: weights change, versions land in the store, reload
and resume reproduce the trained policy, zero-advantage samples are dropped."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.train import OPTIMIZER_FILE, Learner
from loom.contracts.wire import Lineage, LossSpec, RewardResult, TrainBatch, TrajectoryReward
from loom.store import PolicyStore


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a, b, atol=0.0):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


@pytest.mark.parametrize("estimator", ["grpo", "hrpo"])
def test_train_step_changes_weights_and_publishes_a_reloadable_version(
    model_dir, tmp_path, batch_parts, estimator
):
    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store", token_budget=64))
    before = _state(learner.model)
    groups, rewards = batch_parts()
    result = learner.train_step(TrainBatch(step=0, groups=groups, rewards=rewards, estimator=estimator))
    assert result.policy_version == 1 and result.policy is not None
    assert result.policy.path == str(PolicyStore(tmp_path / "store").path_of(1))
    assert result.metrics["samples"] == 8 and result.n_tokens > 0
    assert result.metrics["logprob_mismatch_mean"] > 0  # behaviour log-probs were -4.0 everywhere
    after = _state(learner.model)
    assert not _same(before, after)
    latest = PolicyStore(tmp_path / "store").latest()
    assert latest is not None and latest.version == 1 and latest.meta["step"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(latest.path)
    assert _same(after, _state(reloaded))


def test_resume_after_restart_continues_from_the_last_version(model_dir, tmp_path, batch_parts):
    cfg = LearnerSettings(model=model_dir, store=tmp_path / "store")
    groups, rewards = batch_parts(seed=1)
    first = Learner(cfg)
    first.train_step(TrainBatch(step=0, groups=groups, rewards=rewards))
    trained = _state(first.model)
    opt_state = first.optimizer.state_dict()["state"]
    assert (PolicyStore(cfg.store).path_of(1) / OPTIMIZER_FILE).exists()
    del first  # "crash"

    second = Learner(cfg)
    assert second.version == 1
    assert _same(trained, _state(second.model))
    resumed = second.optimizer.state_dict()["state"]
    assert resumed.keys() == opt_state.keys()
    assert all(torch.equal(resumed[k]["exp_avg"], opt_state[k]["exp_avg"]) for k in resumed)
    # a redelivered step is not trained twice
    replay = second.train_step(TrainBatch(step=0, groups=groups, rewards=rewards))
    assert replay.policy_version == 1 and replay.metrics["replayed"] == 1.0
    assert _same(trained, _state(second.model))
    nxt = second.train_step(TrainBatch(step=1, groups=groups, rewards=rewards))
    assert nxt.policy_version == 2 and PolicyStore(cfg.store).versions() == [1, 2]


def test_zero_advantage_samples_are_dropped_and_counted(model_dir, tmp_path, batch_parts):
    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    groups, rewards = batch_parts(n_groups=2)
    # group 0: everyone has the same reward -> nothing to learn
    rewards[0] = RewardResult(
        group_id="g0",
        rewards=[TrajectoryReward(trajectory_id=r.trajectory_id, total=1.0) for r in rewards[0].rewards],
    )
    batch = TrainBatch(
        step=0,
        groups=groups,
        rewards=rewards,
        estimator_params={"batch_size": 2, "target_groups": 2},
    )
    res = learner.train_step(batch)
    assert res.metrics["dropped_zero_adv"] == 4 and res.metrics["samples"] == 4
    assert res.metrics["valid_groups"] == 1
    assert res.metrics["next_batch_size"] == round(0.9 * 2 + 0.1 * 2 / 1 * 2)
    # a batch with no signal at all: no update, no new version
    only = TrainBatch(step=1, groups=groups[:1], rewards=rewards[:1])
    before = _state(learner.model)
    skipped = learner.train_step(only)
    assert skipped.metrics["skipped"] == 1.0 and skipped.policy_version == 1
    assert _same(before, _state(learner.model))


@pytest.mark.parametrize("estimator", ["grpo", "hrpo"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_micro_batching_accumulates_the_full_batch_gradient(
    model_dir, tmp_path, batch_parts, estimator, mode
):
    groups, rewards = batch_parts(seed=2)
    batch = TrainBatch(
        step=0, groups=groups, rewards=rewards, estimator=estimator, loss=LossSpec(aggregation=mode)
    )
    samples = assign_batch(batch).samples
    grads = []
    for budget in (10_000, 30):
        cfg = LearnerSettings(model=model_dir, store=tmp_path / f"s{budget}", token_budget=budget)
        learner = Learner(cfg)
        learner.accumulate_gradients(samples, batch)
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters()})
    assert sum(float(g.abs().sum()) for g in grads[0].values()) > 0
    assert _same(grads[0], grads[1], atol=1e-6)


def test_kl_to_reference_and_entropy_bonus_run_and_report(model_dir, tmp_path, batch_parts):
    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    groups, rewards = batch_parts(behaviour=None)  # on-policy: ratios are exactly 1
    spec = LossSpec(kl_coef=0.1, entropy_coef=0.01)
    r0 = learner.train_step(TrainBatch(step=0, groups=groups, rewards=rewards, loss=spec))
    assert r0.metrics["kl"] == pytest.approx(0.0, abs=1e-9)  # policy == reference before the update
    assert r0.metrics["entropy"] > 0 and r0.metrics["clip_frac"] == 0.0
    assert r0.metrics["logprob_mismatch_mean"] == 0.0
    r1 = learner.train_step(TrainBatch(step=1, groups=groups, rewards=rewards, loss=spec))
    assert r1.metrics["kl"] > 0


def test_invalid_batch_is_a_value_error(model_dir, tmp_path, batch_parts):
    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    groups, rewards = batch_parts()
    rewards[0].rewards.pop()
    with pytest.raises(ValueError, match="has no reward"):
        learner.train_step(TrainBatch(step=0, groups=groups, rewards=rewards))
    with pytest.raises(ValueError, match="tree"):
        learner.train_step(
            TrainBatch(step=0, groups=groups, rewards=rewards[1:] + rewards[:1], estimator="treerl")
        )


def test_later_passes_are_clipped_even_without_behaviour_logprobs(model_dir, tmp_path, batch_parts):
    # rows without behaviour log-probs are clipped against the first pass's log-probs: before, each
    # pass compared the moved policy with itself (ratio 1), so several passes had no trust region
    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    groups, rewards = batch_parts(streaming=False, behaviour=None)
    spec = LossSpec(lr=3e-2, updates_per_batch=4)
    r = learner.train_step(TrainBatch(step=0, groups=groups, rewards=rewards, loss=spec))
    assert r.metrics["behaviour_logprobs_used"] == 0.0 and r.metrics["updates"] == 4
    assert r.metrics["last_pass_clip_frac"] > 0.1


def test_a_non_finite_gradient_is_never_applied(model_dir, tmp_path, batch_parts):
    learner = Learner(LearnerSettings(model=model_dir, store=tmp_path / "store"))
    before = _state(learner.model)
    groups, rewards = batch_parts()
    batch = TrainBatch(step=0, groups=groups, rewards=rewards)
    # the wire contract refuses NaN; this stands for any NaN that arises inside the learner
    batch.rewards[0].rewards[0] = rewards[0].rewards[0].model_copy(update={"total": float("nan")})
    r = learner.train_step(batch)
    assert r.metrics["skipped"] == 1.0 and r.metrics["nonfinite_grad"] == 1.0
    assert r.policy_version == 0 and PolicyStore(tmp_path / "store").latest() is None
    assert _same(before, _state(learner.model))


def test_warmup_scales_the_first_steps_linearly_then_holds():
    from learner.train import warmup_lr

    assert warmup_lr(1e-4, 0, 0) == 1e-4
    assert [round(warmup_lr(1e-4, 4, k), 12) for k in range(6)] == [2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4]


def test_activation_checkpointing_gives_the_same_gradient(model_dir, tmp_path, batch_parts):
    groups, rewards = batch_parts(seed=7)
    batch = TrainBatch(step=0, groups=groups, rewards=rewards)
    samples = assign_batch(batch).samples
    grads = []
    for ckpt in (False, True):
        cfg = LearnerSettings(model=model_dir, store=tmp_path / str(ckpt), activation_checkpointing=ckpt)
        learner = Learner(cfg)
        assert learner.model.is_gradient_checkpointing == ckpt
        learner.accumulate_gradients(samples, batch)
        grads.append({n: p.grad.clone() for n, p in learner.model.named_parameters()})
    assert sum(float(g.abs().sum()) for g in grads[0].values()) > 0
    assert _same(grads[0], grads[1], atol=1e-6)


def test_lora_with_fsdp_sharding_is_refused_with_its_reason(model_dir, tmp_path):
    """The settings' types refuse what the learner cannot do, before any model is loaded."""
    with pytest.raises(ValueError, match="LoRA .* with sharding='fsdp' is not supported"):
        LearnerSettings(model=model_dir, store=tmp_path, lora_rank=8, sharding="fsdp")
    with pytest.raises(ValueError, match="mixed_precision\n  Input should be 'auto', 'no' or 'bf16'"):
        LearnerSettings(model=model_dir, store=tmp_path, mixed_precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sharding\n  Input should be 'replicate' or 'fsdp'"):
        LearnerSettings(model=model_dir, store=tmp_path, sharding="ddp")  # type: ignore[arg-type]


@pytest.mark.parametrize("resident", [1, 3])
def test_runs_train_their_own_lineages_each_as_if_alone(model_dir, tmp_path, batch_parts, resident):
    """Two runs' steps interleaved on one learner train each run's own policy, step for step as the
    run alone would (the same step numbers are no redelivery of each other); ``resident=1`` switches
    through the store every step. A redelivery is per (lineage, step)."""
    runs = {"run-a": (1, 2), "run-b": (3, 4)}

    def batch(run: str, step: int) -> TrainBatch:
        groups, rewards = batch_parts(seed=runs[run][step])
        return TrainBatch(step=step, lineage=Lineage(namespace=run), groups=groups, rewards=rewards)

    keys = ("loss", "grad_norm", "samples")
    solo = {}
    for run in runs:
        alone = Learner(LearnerSettings(model=model_dir, store=tmp_path / run))
        solo[run] = [alone.train_step(batch(run, k)) for k in (0, 1)]
    shared = Learner(LearnerSettings(model=model_dir, store=tmp_path / "shared", resident_runs=resident))
    got: dict[str, list] = {run: [] for run in runs}
    for step in (0, 1):
        for run in runs:
            got[run].append(shared.train_step(batch(run, step)))
    store = PolicyStore(tmp_path / "shared")
    assert store.versions() == []  # nothing trains the learner's own namespace
    for run in runs:
        for mine, alone in zip(got[run], solo[run], strict=True):
            assert "replayed" not in mine.metrics
            assert mine.policy is not None and mine.policy.namespace == run
            assert mine.policy_version == alone.policy_version and mine.n_tokens == alone.n_tokens
            for k in keys:
                assert mine.metrics[k] == pytest.approx(alone.metrics[k], rel=1e-5, abs=1e-6), (run, k)
        assert store.namespace(run).versions() == [1, 2]
        mine_w = AutoModelForCausalLM.from_pretrained(store.namespace(run).path_of(2))
        alone_w = AutoModelForCausalLM.from_pretrained(PolicyStore(tmp_path / run).namespace(run).path_of(2))
        assert _same(_state(mine_w), _state(alone_w), atol=1e-5)
    again = shared.train_step(batch("run-a", 1))
    assert again.metrics["replayed"] == 1.0 and again.policy_version == 2
    assert again.policy is not None and again.policy.namespace == "run-a"


def test_a_run_from_a_keys_version_continues_its_numbering_in_the_runs_namespace(
    model_dir, tmp_path, batch_parts
):
    """A run's base is one of its key's published versions: its first step trains from those weights
    (as a learner whose model is that checkpoint) and publishes the next number in the run's own
    namespace; the key's namespace is left as it was."""
    import shutil

    store = PolicyStore(tmp_path / "store")
    alice = store.namespace("alice")
    alice.publish(3, lambda d: shutil.copytree(model_dir, d, dirs_exist_ok=True))
    groups, rewards = batch_parts(seed=7)
    lineage = Lineage(namespace="run-x", base_namespace="alice", base_version=3)
    spec = LossSpec(warmup_steps=4)
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(5)  # the deployment's base model: other weights than alice's version
    LlamaForCausalLM(AutoConfig.from_pretrained(model_dir)).save_pretrained(tmp_path / "deployed")
    learner = Learner(LearnerSettings(model=tmp_path / "deployed", store=tmp_path / "store"))
    got = learner.train_step(TrainBatch(step=0, lineage=lineage, groups=groups, rewards=rewards, loss=spec))
    assert got.policy_version == 4 and got.policy is not None and got.policy.namespace == "run-x"
    assert alice.versions() == [3] and store.namespace("run-x").versions() == [4]
    assert lineage.at(3) == ("alice", 3) and lineage.at(4) == ("run-x", 4)
    # the same step from that checkpoint alone: its first warmup step, the same update
    alone = Learner(LearnerSettings(model=model_dir, store=tmp_path / "alone"))
    ref = alone.train_step(TrainBatch(step=0, groups=groups, rewards=rewards, loss=spec))
    assert got.metrics["lr"] == ref.metrics["lr"] == spec.lr / 4
    assert got.metrics["loss"] == pytest.approx(ref.metrics["loss"], rel=1e-5, abs=1e-6)
    assert _same(_state(learner.model), _state(alone.model), atol=1e-6)
