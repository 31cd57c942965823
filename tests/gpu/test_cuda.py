"""Loom on a CUDA device, checked against CPU float32 passes of the same weights.

Users run the learner and the torch engine on GPU hosts (``LOOM_DEVICE=cuda``); CI has no GPU, so every
test here is skipped there with the reason, and they are run on a GPU host with
``python -m pytest tests/gpu``. What they cover:

- the torch engine on CUDA: batched sampling, the prefix cache, the group layout (block mask) and
  the decode step captured in CUDA graphs (``cuda_graphs=True``) are token-exact against a CPU
  teacher-forced pass (tolerance 2e-4 absolute: float32 on both, the
  device's kernels sum in another order); greedy picks the CPU argmax wherever the CPU's top two
  logits are more than 1e-3 apart;
- FCI scoring on CUDA: the streaming scorer equals eager attention on the device and the CPU scores;
- the learner on CUDA: in float32 its first step's loss and gradient norm equal the CPU learner's;
  with bf16 autocast (the default on CUDA) it trains in the direction of the advantages, publishes
  float32 weights that a CPU process loads, the CUDA engine serves the published version, and a CPU
  learner resumes the CUDA-trained store (optimizer state included);
- ``loom engine --device cuda`` through the vLLM-protocol client.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (CI has none): run on a GPU host"
)

from learner.config import LearnerSettings  # noqa: E402
from learner.train import Learner  # noqa: E402
from loom.contracts.wire import (  # noqa: E402
    Group,
    LossSpec,
    RewardResult,
    SamplingParams,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
)
from loom.runtime import configure_process  # noqa: E402
from loom.store import PolicyStore  # noqa: E402
from rollout_svc.engines.base import Layout  # noqa: E402
from rollout_svc.engines.torch import TorchEngine, load_model, teacher_forced_logprobs  # noqa: E402
from zoo.tiny import CHECKPOINT_DIR, reflect_prompt, tiny_problems  # noqa: E402

ATOL = 2e-4


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def cpu() -> TorchEngine:
    configure_process()
    return TorchEngine(CHECKPOINT_DIR, cache_entries=16)


@pytest.fixture(scope="module")
def gpu() -> TorchEngine:
    return TorchEngine(CHECKPOINT_DIR, device="cuda", cache_entries=16)


def _prompts(tokenizer: Any, n: int = 3, seed: int = 3) -> list[list[int]]:
    return [
        list(tokenizer.encode(reflect_prompt(p), add_special_tokens=False))
        for p in tiny_problems("arith", n, seed=seed)
    ]


def test_the_engine_on_cuda_is_token_exact_against_a_cpu_pass(cpu: TorchEngine, gpu: TorchEngine) -> None:
    assert next(gpu.model.parameters()).is_cuda
    prompts = _prompts(gpu.tokenizer)

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(gpu.generate(ids, SamplingParams(n=4, max_tokens=96, seed=i)) for i, ids in enumerate(prompts))
        )

    outs = run(together())
    for ids, completions in zip(prompts, outs, strict=True):
        assert len(completions) == 4
        for c in completions:
            assert len(c.logprobs) == len(c.token_ids) > 0
            ref = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=ATOL)
    assert gpu.stats.extra["peak_batch_requests"] > 1  # the requests were decoded together
    # the prefix cache lives on the device too: the same prompt again is served from it
    (again,) = run(gpu.generate(prompts[0], SamplingParams(max_tokens=8, seed=11)))
    assert again.cached_tokens > 0
    ref = teacher_forced_logprobs(cpu.model, prompts[0] + again.token_ids, len(prompts[0]))
    assert again.logprobs == pytest.approx(ref, abs=ATOL)


def test_an_engine_handed_a_cuda_model_runs_on_the_model_s_device(cpu: TorchEngine, gpu: TorchEngine) -> None:
    shared = TorchEngine(gpu.model_path, model=gpu.model, tokenizer=gpu.tokenizer, cache_entries=4)
    assert shared.device.startswith("cuda")  # not the "cpu" default: its inputs must live beside the model
    ids = _prompts(gpu.tokenizer, 1, seed=6)[0]
    (c,) = run(shared.generate(ids, SamplingParams(max_tokens=16, seed=1)))
    ref = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids))
    assert c.logprobs == pytest.approx(ref, abs=ATOL)


def test_greedy_on_cuda_picks_the_cpu_argmax(cpu: TorchEngine, gpu: TorchEngine) -> None:
    checked = 0
    for ids in _prompts(gpu.tokenizer, n=3, seed=4):
        (c,) = run(gpu.generate(ids, SamplingParams(max_tokens=64, temperature=0.0)))
        seq = ids + c.token_ids
        with torch.no_grad():
            logits = cpu.model(torch.tensor([seq])).logits[0, len(ids) - 1 : len(seq) - 1]
        top2 = logits.topk(2, dim=-1)
        for i, tok in enumerate(c.token_ids):
            if float(top2.values[i, 0] - top2.values[i, 1]) > 1e-3:  # not a near tie
                assert tok == int(top2.indices[i, 0]), f"token {i}"
                checked += 1
    assert checked > 50


def test_the_group_layout_on_cuda_matches_a_cpu_pass(cpu: TorchEngine, gpu: TorchEngine) -> None:
    tok = gpu.tokenizer
    src = list(tok.encode("[stream] The first number is 12.", add_special_tokens=False))
    tgt = list(tok.encode(" a=12", add_special_tokens=False))
    more = list(tok.encode(" The second number is 30.", add_special_tokens=False))
    ids = src + tgt + more
    layout = Layout(groups=[0] * len(src) + [1] * len(tgt) + [0] * len(more), gen_group=1)
    outs = run(gpu.generate(ids, SamplingParams(n=2, max_tokens=24, seed=4), layout))
    for c in outs:
        ref = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids), layout)
        assert c.logprobs == pytest.approx(ref, abs=ATOL)
        plain = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids))
        assert c.logprobs != pytest.approx(plain, abs=ATOL)  # the layout really changed the view


def test_fci_on_cuda_equals_eager_attention_and_the_cpu_scores(cpu: TorchEngine, gpu: TorchEngine) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from loom.fci import fci_scores, fci_scores_eager

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 256, (1024,), generator=torch.Generator().manual_seed(1)).tolist()
    steps = [(a, a + 32) for a in range(0, 1024, 32)]
    on_cpu = fci_scores(model, ids, steps, delta=4, block=128)
    model.to("cuda")
    streaming = fci_scores(model, ids, steps, delta=4, block=128)
    eager = fci_scores_eager(model, ids, steps, delta=4)
    assert max(abs(x) for x in streaming) > 0
    scale = max(abs(x) for x in eager)
    assert streaming == pytest.approx(eager, abs=1e-4 * scale)
    assert streaming == pytest.approx(on_cpu, abs=1e-4 * scale)
    # the engine's own scorer (tree mode's attention strategy) on the device
    (c,) = run(cpu.generate(_prompts(cpu.tokenizer, 1, seed=5)[0], SamplingParams(max_tokens=80, seed=2)))
    seq = _prompts(cpu.tokenizer, 1, seed=5)[0] + c.token_ids
    spans = [(a, min(len(seq), a + 8)) for a in range(0, len(seq), 8)]
    want = run(cpu.score_attention(seq, spans, delta=2))
    got = run(gpu.score_attention(seq, spans, delta=2))
    assert got == pytest.approx(want, abs=1e-4 * max(want))


def test_tree_and_spawn_modes_run_on_cuda(cpu: TorchEngine, gpu: TorchEngine) -> None:
    from loom.contracts.modes import parse_mode_params
    from loom.contracts.wire import RolloutRequest
    from rollout_svc.modes.spawn import spawn
    from rollout_svc.modes.tree import tree
    from zoo.tiny import spawn_prompt

    problem = tiny_problems("arith", 1, seed=1)[0]
    req = RolloutRequest(
        mode="tree",
        prompt=reflect_prompt(problem),
        sampling=SamplingParams(max_tokens=120, seed=5),
        mode_params={"initial": 3, "delta": 2, "min_distance": 4, "strategy": "attention"},
    )
    ids = list(gpu.tokenizer.encode(req.prompt, add_special_tokens=False))
    group = run(tree(req, ids, "g", gpu, gpu.tokenizer, parse_mode_params(req)))
    assert group.tree and sum(len(p) for p in group.meta["branch_points"].values()) > 0
    for t in group.trajectories:  # every leaf, branches included, is token-exact
        ref = teacher_forced_logprobs(cpu.model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
        assert t.logprobs == pytest.approx(ref, abs=ATOL)

    countdown = tiny_problems("countdown", 1, seed=2)[0]
    sreq = RolloutRequest(
        mode="spawn", prompt=spawn_prompt(countdown), sampling=SamplingParams(max_tokens=200, seed=3)
    )
    sids = list(gpu.tokenizer.encode(sreq.prompt, add_special_tokens=False))
    sgroup = run(spawn(sreq, sids, "s", gpu, gpu.tokenizer, parse_mode_params(sreq)))
    assert sgroup.meta["rollouts"][0]["status"] == "ok" and sgroup.meta["children"] >= 1
    for t in sgroup.trajectories:
        ref = teacher_forced_logprobs(cpu.model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
        trained = [i for i, m in enumerate(t.loss_mask) if m]
        assert [t.logprobs[i] for i in trained] == pytest.approx([ref[i] for i in trained], abs=ATOL)


def test_a_bf16_engine_on_cuda_stays_within_the_cpu_measured_tolerance(cpu: TorchEngine) -> None:
    """bf16 weights and KV cache on the device against the CPU float32 teacher-forced pass; the bounds
    are the CPU bf16 ones (tests/rollout_modes/test_engine_scale.py, docs/benchmarks/engine.md)."""
    engine = TorchEngine(CHECKPOINT_DIR, device="cuda", dtype="bfloat16", cache_entries=4)
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    prompts = _prompts(engine.tokenizer, n=4, seed=12)

    async def together() -> list[Any]:
        return await asyncio.gather(
            *(
                engine.generate(ids, SamplingParams(n=2, max_tokens=64, seed=i))
                for i, ids in enumerate(prompts)
            )
        )

    diffs = []
    for ids, completions in zip(prompts, run(together()), strict=True):
        for c in completions:
            ref = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids))
            diffs += [abs(a - b) for a, b in zip(c.logprobs, ref, strict=True)]
    assert sum(diffs) / len(diffs) < 0.01 and max(diffs) < 0.6


def test_the_cuda_kv_budget_is_half_the_free_memory_and_holds_256_rows(cpu: TorchEngine) -> None:
    from rollout_svc.engines.torch.scheduler import default_kv_budget

    free, _ = torch.cuda.mem_get_info()
    assert default_kv_budget("cuda") == pytest.approx(free // 2, rel=0.05)
    engine = TorchEngine(CHECKPOINT_DIR, device="cuda", cache_entries=0)
    assert engine.max_batch_rows is None
    ids = _prompts(engine.tokenizer, 1, seed=13)[0]

    async def many() -> list[Any]:
        return await asyncio.gather(
            *(
                engine.generate(ids, SamplingParams(max_tokens=16, seed=i, ignore_eos=True))
                for i in range(256)
            )
        )

    outs = run(many())
    assert all(len(o[0].token_ids) == 16 for o in outs)
    assert engine.stats.extra["peak_batch_rows"] > 64  # the old fixed cap is gone
    ref = teacher_forced_logprobs(cpu.model, ids + outs[0][0].token_ids, len(ids))
    assert outs[0][0].logprobs == pytest.approx(ref, abs=ATOL)


def test_the_decode_step_in_cuda_graphs_is_token_exact_and_replayed(cpu: TorchEngine) -> None:
    """``cuda_graphs=True``: the batched decode step is captured once per row bucket and replayed
    (rollout_svc/engines/torch/decode.py); greedy and seeded rows, rows leaving at different steps
    and a request joining the running batch stay token-exact against the CPU pass."""
    engine = TorchEngine(CHECKPOINT_DIR, device="cuda", cache_entries=4, cuda_graphs=True)
    assert engine.cuda_graphs and engine.scheduler.decode.mode == "graphs"
    assert not TorchEngine(CHECKPOINT_DIR, cache_entries=0, cuda_graphs=True).cuda_graphs  # never on CPU
    prompts = _prompts(engine.tokenizer, n=5, seed=21)
    params = [
        SamplingParams(n=3, max_tokens=64, seed=1),
        SamplingParams(max_tokens=48, temperature=0.0),
        SamplingParams(n=2, max_tokens=24, seed=2, logprobs=2),
        SamplingParams(max_tokens=80, temperature=0.7, seed=3),
        SamplingParams(max_tokens=40, temperature=0.0),
    ]

    async def staggered(e: TorchEngine) -> list[Any]:
        first = [asyncio.create_task(e.generate(i, p)) for i, p in zip(prompts[:4], params[:4], strict=True)]
        while e.stats.extra["decode_steps"] < 5:  # the batch is running: the last one joins it
            await asyncio.sleep(0.005)
        last = await e.generate(prompts[4], params[4])
        return [*(await asyncio.gather(*first)), last]

    got = run(staggered(engine))
    decode = engine.scheduler.decode
    assert decode.graph_error is None, decode.graph_error
    assert decode.captures >= 1 and decode.replays >= 20  # the steps really ran as graph replays
    for ids, completions in zip(prompts, got, strict=True):
        for c in completions:
            ref = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=ATOL)
    # the greedy rows pick the CPU argmax wherever it is not a near tie
    for k in (1, 4):
        ids, c = prompts[k], got[k][0]
        with torch.no_grad():
            logits = cpu.model(torch.tensor([ids + c.token_ids])).logits[0, len(ids) - 1 : -1]
        top2 = logits.topk(2, dim=-1)
        for i, tok in enumerate(c.token_ids):
            if float(top2.values[i, 0] - top2.values[i, 1]) > 1e-3:
                assert tok == int(top2.indices[i, 0]), f"request {k} token {i}"
    engine.stop_scheduler()


# ------------------------------------------------------------------------------------------ learner


@pytest.fixture(scope="module")
def batch(cpu: TorchEngine) -> TrainBatch:
    """Real tiny-model samples, 4 per prompt; in each group the first two are rewarded 1, the rest 0."""
    groups, rewards = [], []
    for k, ids in enumerate(_prompts(cpu.tokenizer, n=3, seed=8)):
        outs = run(cpu.generate(ids, SamplingParams(n=4, max_tokens=64, seed=20 + k)))
        trajs = [
            Trajectory(
                id=f"g{k}-{i}",
                group_id=f"g{k}",
                prompt_ids=ids,
                completion_ids=c.token_ids,
                logprobs=c.logprobs,
                loss_mask=[1] * len(c.token_ids),
            )
            for i, c in enumerate(outs)
        ]
        groups.append(Group(id=f"g{k}", mode="plain", trajectories=trajs))
        rewards.append(
            RewardResult(
                group_id=f"g{k}",
                rewards=[
                    TrajectoryReward(trajectory_id=t.id, total=float(i < 2)) for i, t in enumerate(trajs)
                ],
            )
        )
    return TrainBatch(step=0, groups=groups, rewards=rewards, loss=LossSpec(lr=1e-3))


def _mean_logp(model: Any, batch: TrainBatch, rewarded: bool) -> float:
    by_id = {r.trajectory_id: r.total for res in batch.rewards for r in res.rewards}
    vals = [
        sum(teacher_forced_logprobs(model, t.prompt_ids + t.completion_ids, len(t.prompt_ids)))
        for g in batch.groups
        for t in g.trajectories
        if (by_id[t.id] > 0) == rewarded
    ]
    return sum(vals) / len(vals)


def test_the_learner_on_cuda_in_float32_takes_the_cpu_step(batch: TrainBatch, tmp_path: Path) -> None:
    on_cpu = Learner(LearnerSettings(model="tiny", store=tmp_path / "cpu"))
    on_gpu = Learner(
        LearnerSettings(model="tiny", store=tmp_path / "gpu", device="cuda", mixed_precision="no")
    )
    a, b = on_cpu.train_step(batch), on_gpu.train_step(batch)
    assert a.policy_version == b.policy_version == 1
    for key in ("first_pass_loss", "grad_norm", "logprob_mismatch_mean"):
        if key in a.metrics:
            assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-3, abs=1e-6), key
    assert "grad_norm" in a.metrics and a.metrics["grad_norm"] > 0


@pytest.fixture(scope="module")
def bf16_store(batch: TrainBatch, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any]]:
    store = tmp_path_factory.mktemp("bf16") / "store"
    learner = Learner(LearnerSettings(model="tiny", store=store, device="cuda"))  # bf16 autocast: the default
    results = [learner.train_step(batch.model_copy(update={"step": s})) for s in range(3)]
    yield store, results


def test_bf16_training_on_cuda_follows_the_advantages_and_publishes_float32(
    cpu: TorchEngine, batch: TrainBatch, bf16_store: tuple[Path, Any]
) -> None:
    store, results = bf16_store
    assert [r.policy_version for r in results] == [1, 2, 3]
    for r in results:
        assert all(math.isfinite(v) for v in r.metrics.values())
        assert r.metrics.get("skipped", 0.0) == 0.0
    latest = PolicyStore(store).latest()
    assert latest is not None and latest.version == 3
    trained = load_model(latest.path)  # a CPU process loads what the CUDA learner published
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    base_gap = _mean_logp(cpu.model, batch, True) - _mean_logp(cpu.model, batch, False)
    gap = _mean_logp(trained, batch, True) - _mean_logp(trained, batch, False)
    assert gap > base_gap + 0.5  # the rewarded samples gained log-likelihood over the others


def test_the_cuda_engine_serves_a_cuda_trained_version_and_a_cpu_learner_resumes_it(
    gpu: TorchEngine, batch: TrainBatch, bf16_store: tuple[Path, Any], tmp_path: Path
) -> None:
    import shutil

    store, _ = bf16_store
    latest = PolicyStore(store).latest()
    assert latest is not None
    engine = TorchEngine(CHECKPOINT_DIR, device="cuda", cache_entries=4)
    run(engine.load_policy(latest))
    assert engine.policy_version == 3 and next(engine.model.parameters()).is_cuda
    reference = load_model(latest.path)
    ids = _prompts(engine.tokenizer, 1, seed=9)[0]
    for c in run(engine.generate(ids, SamplingParams(n=2, max_tokens=48, seed=1))):
        ref = teacher_forced_logprobs(reference, ids + c.token_ids, len(ids))
        assert c.logprobs == pytest.approx(ref, abs=ATOL)
    # a CPU learner picks the CUDA-trained store up where it stopped (weights and optimizer state)
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    resumed = Learner(LearnerSettings(model="tiny", store=copy))
    assert resumed.version == 3
    assert resumed.optimizer.state_dict()["state"], "the optimizer state was not restored"
    for p in resumed.optimizer.state_dict()["state"].values():
        assert p["exp_avg"].device.type == "cpu"
    nxt = resumed.train_step(batch.model_copy(update={"step": 3}))
    assert nxt.policy_version == 4 and all(math.isfinite(v) for v in nxt.metrics.values())


def test_loom_engine_on_cuda_through_the_vllm_client(cpu: TorchEngine) -> None:
    import os
    import subprocess
    import sys
    import time

    import httpx

    from rollout_svc.engines.vllm import VLLMEngine

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "engine", "--port", str(port)]
        + ["--model", "tiny", "--device", "cuda"],
        cwd=repo,
        env={**os.environ, "LOOM_TORCH_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"loom engine exited with {proc.returncode}"
            assert time.monotonic() < deadline, "loom engine did not become healthy in 120 s"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        client = VLLMEngine(url, timeout=60, retries=1)
        ids = _prompts(cpu.tokenizer, 1, seed=10)[0]

        async def go() -> list[Any]:
            try:
                return await client.generate(ids, SamplingParams(n=3, max_tokens=48, seed=6))
            finally:
                await client.close()

        outs = run(go())
        assert len(outs) == 3
        for c in outs:
            ref = teacher_forced_logprobs(cpu.model, ids + c.token_ids, len(ids))
            assert c.logprobs == pytest.approx(ref, abs=ATOL)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


# ---------------------------------------------------------------- issue 37: the learner's packed path


def test_the_packed_learner_on_cuda_takes_the_padded_step(batch: TrainBatch, tmp_path: Path) -> None:
    """Packed rows + the fused chunked head against one padded row per trajectory + the whole logits,
    float32 on the device: the same first step."""
    results = []
    for name, packing, chunk in (("padded", False, 0), ("packed", True, 32)):
        cfg = LearnerSettings(
            model="tiny",
            store=tmp_path / name,
            device="cuda",
            mixed_precision="no",
            packing=packing,
            logprob_chunk=chunk,
            token_budget=256,
        )
        results.append(Learner(cfg).train_step(batch))
    a, b = results
    for key in ("loss", "grad_norm", "logprob_mismatch_mean"):
        assert b.metrics[key] == pytest.approx(a.metrics[key], rel=1e-4, abs=1e-6), key


def test_the_fused_head_in_bf16_on_cuda_stays_near_the_float32_logprobs(batch: TrainBatch) -> None:
    from learner import logprobs as lp

    model = load_model(CHECKPOINT_DIR).to("cuda")
    trajs = [t for g in batch.groups for t in g.trajectories]
    with torch.no_grad():
        (ref,) = lp.recompute(model, trajs, token_budget=100_000)
        (bf16,) = lp.recompute(
            model, trajs, token_budget=100_000, packing=True, chunk=64, autocast_dtype=torch.bfloat16
        )
    by_index = {i: r for r, i in enumerate(ref.index)}
    for r, i in enumerate(bf16.index):
        n = len(trajs[i].completion_ids)
        diff = (bf16.logp[r, :n] - ref.logp[by_index[i], :n]).abs()
        assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5  # bf16 matmuls, float32 softmax
