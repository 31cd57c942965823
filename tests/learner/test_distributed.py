"""The learner as 2 ranks on CPU with gloo (learner/distributed.py), replicated and sharded with FSDP2:
each step equals the one-process step on the same batch for every aggregation mode and HRPO, a resume
from the ranks' sharded checkpoint continues the same loss curve, and a killed rank fails the step with
nothing published."""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from learner import logprobs as lp
from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.distributed import STOP, RankFailure, Ranks
from learner.helper_rank import start_helpers
from learner.train import Learner
from loom.contracts.wire import LossSpec, TrainBatch
from loom.store import PolicyStore

# float32 gradient sums in another order, then AdamW: a step's weights agree to 1e-6 (lr 1e-4). FSDP
# too: its reduce-scatter is the same float32 sum (measured ~1.5e-7 with unequal micro-batch counts)
ATOL = 1e-6

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _batches(batch_parts) -> list[TrainBatch]:
    groups, rewards = batch_parts(n_groups=3, seed=4)
    specs = [("grpo", m) for m in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")]
    return [
        TrainBatch(step=i, groups=groups, rewards=rewards, estimator=est, loss=LossSpec(aggregation=agg))
        for i, (est, agg) in enumerate([*specs, ("hrpo", "token_mean")])
    ]


class TwoRanks:
    """Rank 0 in this process (as in the learner worker), rank 1 a child process."""

    def __init__(self, model_dir: Path, store: Path, **options: Any) -> None:
        torch.set_num_threads(1)
        port = _port()
        cfg = LearnerSettings(model=model_dir, store=store, **options)
        self.helpers = start_helpers(2, "127.0.0.1", port, cfg)
        self.ranks = Ranks.init(0, 2, "127.0.0.1", port, timeout_s=60)
        self.learner = Learner(cfg, ranks=self.ranks)

    def close(self, stop: bool = True) -> list[int | None]:
        try:
            if stop:
                self.ranks.broadcast(STOP)
        finally:
            self.ranks.close()
            torch.set_num_threads(os.cpu_count() or 1)
        return [h.wait(timeout=60) for h in self.helpers]


def test_two_ranks_take_the_one_process_step_for_every_aggregation_and_hrpo(model_dir, tmp_path, batch_parts):
    batches = _batches(batch_parts)
    one = Learner(LearnerSettings(model=model_dir, store=tmp_path / "one"))
    two = TwoRanks(model_dir, tmp_path / "two")
    try:
        for batch in batches:
            r1, r2 = one.train_step(batch), two.learner.train_step(batch)
            assert r1.policy_version == r2.policy_version == batch.step + 1
            assert r2.metrics["loss"] == pytest.approx(r1.metrics["loss"], rel=1e-5, abs=1e-7)
            assert r2.n_tokens == r1.n_tokens and r2.metrics["seq_tokens"] == r1.metrics["seq_tokens"]
            a, b = _state(one.model), _state(two.learner.model)
            worst = max(float((a[k] - b[k]).abs().max()) for k in a)
            assert worst <= ATOL, (batch.estimator, batch.loss.aggregation, worst)
        assert any(
            not torch.equal(v, w)
            for v, w in zip(
                _state(one.model).values(),
                _state(Learner(LearnerSettings(model=model_dir, store=tmp_path / "fresh")).model).values(),
                strict=True,
            )
        )
    finally:
        codes = two.close()
    assert codes == [0]  # the helper rank left its loop on STOP


def test_a_killed_rank_fails_the_step_and_nothing_is_published(model_dir, tmp_path, batch_parts):
    batch = _batches(batch_parts)[0]
    two = TwoRanks(model_dir, tmp_path / "store")
    try:
        two.helpers[0].send_signal(signal.SIGKILL)
        two.helpers[0].wait(timeout=30)
        with pytest.raises(RankFailure):
            two.learner.train_step(batch)
    finally:
        two.close(stop=False)
    assert PolicyStore(tmp_path / "store").latest() is None


def test_resume_from_the_sharded_checkpoint_continues_the_same_loss_curve(model_dir, tmp_path, batch_parts):
    groups, rewards = batch_parts(n_groups=3, seed=6)
    batches = [TrainBatch(step=i, groups=groups, rewards=rewards, loss=LossSpec(lr=1e-3)) for i in range(4)]
    one = Learner(LearnerSettings(model=model_dir, store=tmp_path / "one"))
    curve = [one.train_step(b).metrics["loss"] for b in batches]
    store = tmp_path / "two"
    got = []
    for part in (batches[:2], batches[2:]):
        # no optimizer.pt in the versions: AdamW's moments come back only from the sharded checkpoint
        two = TwoRanks(model_dir, store, save_optimizer=False)
        try:
            assert two.learner.version == part[0].step
            got += [two.learner.train_step(b).metrics["loss"] for b in part]
            state = _state(two.learner.model)
        finally:
            two.close()
        assert sorted(p.name for p in (store / "sharded").iterdir()) == [f"v{part[-1].step + 1}"]
    assert not (store / "v4" / "optimizer.pt").exists()
    assert got == pytest.approx(curve, rel=1e-5, abs=1e-7)
    assert len(set(curve)) == 4  # the curve moves: a reset optimizer would not give the same losses
    a = _state(one.model)
    assert max(float((a[k] - state[k]).abs().max()) for k in a) <= 10 * ATOL


def test_two_ranks_train_a_lora_adapter_as_one_process(model_dir, tmp_path, batch_parts):
    pytest.importorskip("peft")
    batch = _batches(batch_parts)[0].model_copy(update={"loss": LossSpec(lr=1e-2)})
    # the adapter's A is drawn at random: the same seed in both processes' rank 0; rank 1 gets rank 0's
    torch.manual_seed(0)
    one = Learner(LearnerSettings(model=model_dir, store=tmp_path / "one", lora_rank=8))
    torch.manual_seed(0)
    two = TwoRanks(model_dir, tmp_path / "two", lora_rank=8)
    try:
        r1, r2 = one.train_step(batch), two.learner.train_step(batch)
        a, b = _state(one.model), _state(two.learner.model)
    finally:
        two.close()
    assert r1.policy is not None and r2.policy is not None and r2.policy.kind == "lora"
    lora = [k for k in a if "lora_B" in k]
    assert lora and all(float(a[k].abs().max()) > 0 for k in lora)  # B starts at 0: the step moved it
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= ATOL


def _published(result) -> dict[str, torch.Tensor]:
    """The plain checkpoint a step published (what the engines load)."""
    from safetensors.torch import load_file

    assert result.policy is not None and result.policy.kind == "full"
    return load_file(str(Path(result.policy.path) / "model.safetensors"))


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_fsdp_ranks_take_the_one_process_step_for_every_aggregation_and_hrpo(
    model_dir, tmp_path, batch_parts
):
    batches = _batches(batch_parts)
    # the last batch is clipped: its gradient norm is far above 0.05, so the global norm must be right
    batches.append(batches[0].model_copy(update={"step": 4, "loss": LossSpec(max_grad_norm=0.05)}))
    budget = 60  # micro-batches of a few rows: the ranks have different counts (idle passes even them)
    samples = assign_batch(batches[0]).samples
    counts = [
        len(
            lp.micro_batches(
                [len(s.trajectory.prompt_ids) + len(s.trajectory.completion_ids) for s in share], budget
            )
        )
        for share in (samples[0::2], samples[1::2])
    ]
    assert counts[0] != counts[1], counts
    one = Learner(LearnerSettings(model=model_dir, store=tmp_path / "one"))
    two = TwoRanks(model_dir, tmp_path / "two", sharding="fsdp", token_budget=budget)
    try:
        # sharded: every rank holds half of each parameter and of AdamW's moments
        emb = two.learner.model.get_input_embeddings().weight
        assert type(emb).__name__ == "DTensor" and emb.to_local().shape[0] == emb.shape[0] // 2
        for batch in batches:
            r1, r2 = one.train_step(batch), two.learner.train_step(batch)
            assert r1.policy_version == r2.policy_version == batch.step + 1
            assert r2.metrics["loss"] == pytest.approx(r1.metrics["loss"], rel=1e-5, abs=1e-7)
            assert r2.metrics["grad_norm"] == pytest.approx(r1.metrics["grad_norm"], rel=1e-5)
            assert r2.n_tokens == r1.n_tokens and r2.metrics["seq_tokens"] == r1.metrics["seq_tokens"]
            worst = _worst(_state(one.model), _published(r2))
            assert worst <= ATOL, (batch.estimator, batch.loss.aggregation, worst)
        assert r1.metrics["grad_norm"] > 0.05 * 10  # the last step was clipped
        moments = two.learner.optimizer.state[emb]["exp_avg"]
        assert moments.to_local().shape[0] == emb.shape[0] // 2
    finally:
        codes = two.close()
    assert codes == [0]
    # optimizer.pt of an FSDP version is a plain optimizer state: one process resumes from it
    again = Learner(LearnerSettings(model=model_dir, store=tmp_path / "two"))
    a, b = one.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert set(a) == set(b)
    for i in a:
        assert float(a[i]["step"]) == float(b[i]["step"]) == 5
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(a[i][m], b[i][m], rtol=1e-4, atol=1e-9), (i, m)


def test_fsdp_with_activation_checkpointing_takes_the_same_step(model_dir, tmp_path, batch_parts):
    batch = _batches(batch_parts)[3]  # HRPO
    one = Learner(LearnerSettings(model=model_dir, store=tmp_path / "one"))
    two = TwoRanks(model_dir, tmp_path / "two", sharding="fsdp", activation_checkpointing=True)
    try:
        assert two.learner.model.is_gradient_checkpointing
        r1, r2 = one.train_step(batch), two.learner.train_step(batch)
    finally:
        two.close()
    assert r2.metrics["loss"] == pytest.approx(r1.metrics["loss"], rel=1e-5, abs=1e-7)
    assert _worst(_state(one.model), _published(r2)) <= ATOL


@pytest.mark.parametrize("optimizer_from", ["sharded", "optimizer.pt"])
def test_fsdp_resume_continues_the_same_loss_curve(model_dir, tmp_path, batch_parts, optimizer_from):
    groups, rewards = batch_parts(n_groups=3, seed=6)
    batches = [TrainBatch(step=i, groups=groups, rewards=rewards, loss=LossSpec(lr=1e-3)) for i in range(4)]
    one = Learner(LearnerSettings(model=model_dir, store=tmp_path / "one"))
    curve = [one.train_step(b).metrics["loss"] for b in batches]
    store = tmp_path / "two"
    got = []
    for part in (batches[:2], batches[2:]):
        # AdamW's moments come back from the ranks' sharded checkpoint alone (no optimizer.pt), or
        # from the plain optimizer.pt alone (the sharded checkpoint removed)
        two = TwoRanks(model_dir, store, sharding="fsdp", save_optimizer=optimizer_from == "optimizer.pt")
        try:
            assert two.learner.version == part[0].step
            results = [two.learner.train_step(b) for b in part]
            got += [r.metrics["loss"] for r in results]
        finally:
            two.close()
        assert sorted(p.name for p in (store / "sharded").iterdir()) == [f"v{part[-1].step + 1}"]
        if optimizer_from == "optimizer.pt":
            shutil.rmtree(store / "sharded")
    assert (store / "v4" / "optimizer.pt").exists() == (optimizer_from == "optimizer.pt")
    assert got == pytest.approx(curve, rel=1e-5, abs=1e-7)
    assert len(set(curve)) == 4  # the curve moves: a reset optimizer would not give the same losses
    assert _worst(_state(one.model), _published(results[-1])) <= 10 * ATOL


def test_fsdp_a_killed_rank_fails_the_step_and_nothing_is_published(model_dir, tmp_path, batch_parts):
    batch = _batches(batch_parts)[0]
    two = TwoRanks(model_dir, tmp_path / "store", sharding="fsdp")
    try:
        two.helpers[0].send_signal(signal.SIGKILL)
        two.helpers[0].wait(timeout=30)
        with pytest.raises(RankFailure):
            two.learner.train_step(batch)
    finally:
        two.close(stop=False)
    assert PolicyStore(tmp_path / "store").latest() is None
    assert not (tmp_path / "store" / "sharded").exists()


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_bf16_mixed_precision_runs_on_cpu_close_to_float32(model_dir, tmp_path, batch_parts, sharding):
    batch = _batches(batch_parts)[0]
    fp32 = Learner(LearnerSettings(model=model_dir, store=tmp_path / "fp32")).train_step(batch)
    two = TwoRanks(model_dir, tmp_path / "bf16", sharding=sharding, mixed_precision="bf16")
    try:
        assert two.learner.compute_dtype() == torch.bfloat16
        bf16 = two.learner.train_step(batch)
        published = _published(bf16)
    finally:
        two.close()
    assert math.isfinite(bf16.metrics["loss"]) and math.isfinite(bf16.metrics["grad_norm"])
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per op): on this batch (loss -0.0435,
    # grad norm 0.642) one process measured |d loss| 1.2e-5 and a grad norm 1e-4 apart; the bounds
    # leave ~30x room for the ranks' other summation order, and bf16 did change the numbers
    assert bf16.metrics["loss"] != fp32.metrics["loss"]
    assert bf16.metrics["loss"] == pytest.approx(fp32.metrics["loss"], abs=5e-4)
    assert bf16.metrics["grad_norm"] == pytest.approx(fp32.metrics["grad_norm"], rel=5e-3)
    assert all(v.dtype == torch.float32 for v in published.values())  # float32 master weights
