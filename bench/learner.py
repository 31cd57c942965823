"""Learner train-step cost: HRPO vs GRPO on the same batch (ratio), train-step tokens/s, and 1 vs N ranks.

HRPO's three terms share one forward and one backward (AdaSR eq. 10), so its step should cost about
what a GRPO step costs. Both estimators train the SAME streaming batch (stream / observation / deep
segments, HRPO reward components), alternating step by step in one run on fresh copies of the model;
``train_seconds`` is the step without publishing, ``wall`` includes writing the version to the store.

With ``--ranks N`` (N > 1) the same GRPO step also runs on N data-parallel ranks (learner/distributed.py:
this process is rank 0, the others its children, gloo on CPU, one torch thread per rank) alternating
step by step with a one-process learner at one torch thread and at N threads: tokens/s side by side.
``--sharding replicate,fsdp`` runs the ranks once per layout (a process has one process group, so the
layouts run one after the other, each interleaved with its own one-process learners) and adds what
each rank holds: parameter + AdamW state bytes on rank 0, and rank 1's peak RSS (VmHWM).

With ``--size NAME`` (``SIZES``: 2m, 20m, 125m, 350m, 1b) the bench builds a Llama model of that size
from a config with random weights (seeded; a throughput figure needs no trained weights) and trains
one synthetic GRPO batch, the same for each ``--variants`` entry, one variant after the other: ``full``
(one process, full fine-tuning), ``lora`` (one process, a rank ``--lora-rank`` adapter), ``fsdp``
(``--ranks`` ranks, FSDP2-sharded; on CUDA it needs one GPU per rank). Per variant: median step
seconds and tokens/s of ``--steps`` steps after a warm-up, the trainable parameters + AdamW state and
all parameters + AdamW state this process holds, and the peak memory: ``torch.cuda.max_memory_allocated``
on CUDA (reset before each variant), on CPU the growth of the process's peak RSS (VmHWM, reset through
/proc/self/clear_refs) over its RSS before the variant. ``--mixed-precision`` and
``--activation-checkpointing`` pass through to ``LearnerSettings``.

    python bench/learner.py [--model tiny|PATH] [--groups 4] [--g 8] [--len 96] [--steps 5] [--device cpu]
                            [--ranks 2] [--sharding replicate,fsdp]
    python bench/learner.py --size 1b --variants full,lora,fsdp [--device cuda] [--mixed-precision bf16]
                            [--activation-checkpointing] [--lora-rank 8] [--ranks 2]
    python bench/learner.py --packing [--size 10m] [--groups 4] [--g 8] [--min-len 16] [--max-len 512]

With ``--packing`` (issue 37) the same GRPO batch of mixed lengths (``--min-len`` to ``--max-len``
prompt+completion tokens, uniform) is trained by the padded learner as it was before packing
(``packing=False, logprob_chunk=0``: one row per trajectory, the whole logits) and by the packed one
(``packing=True`` and the fused chunked head, the defaults), alternating step by step in one run on a
random-weight Llama of ``--size`` (default 10m), one torch thread: median tokens/s side by side, and the
computed tokens (rows x row width summed over the micro-batches) over the real ones, and each step's
CPU seconds (``time.process_time``, publishing included: on a shared machine less load-bound than the
wall time). ``--row-mask`` adds the first packed learner of issue 37 (sdpa with the row's block mask,
the head's logits recomputed in the backward) as a third side. ``--compile inductor`` adds the packed
learner with its decoder layers compiled (``torch_compile``, learner/train.py ``compile_layers``) as a
side of its own: its compilation happens before the timed steps (the equality check's forward and the
warm-up step; their seconds are printed per side), and the run prints how far it is from the packed
learner on the same weights: the completion log-probs' max |difference| before any step, the warm-up
step's loss and the weights after it; and the graphs compiled before and during the timed steps.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# `python bench/learner.py` puts bench/ first on sys.path, where this file would shadow the package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from loom.contracts.wire import Group, RewardResult, Segment, TrainBatch, Trajectory, TrajectoryReward  # noqa: E402
from loom.runtime import configure_process  # noqa: E402


def make_batch(
    n_groups: int, g: int, length: int, vocab: int, seed: int = 0
) -> tuple[list[Group], list[RewardResult]]:
    rnd = random.Random(seed)
    groups, results = [], []
    for gi in range(n_groups):
        trajs, rewards = [], []
        for i in range(g):
            n = rnd.randint(length // 2, length)
            s1, o1, s2 = n // 4, n // 4 + 6, n // 2
            trajs.append(
                Trajectory(
                    id=f"g{gi}t{i}",
                    group_id=f"g{gi}",
                    prompt_ids=[rnd.randrange(3, vocab) for _ in range(24)],
                    completion_ids=[rnd.randrange(3, vocab) for _ in range(n)],
                    logprobs=[-rnd.random() * 3 for _ in range(n)],
                    loss_mask=[0 if s1 <= j < o1 else 1 for j in range(n)],
                    segments=[
                        Segment(kind="stream", start=0, end=s1),
                        Segment(kind="observation", start=s1, end=o1),
                        Segment(kind="stream", start=o1, end=s2),
                        Segment(kind="deep", start=s2, end=n),
                    ],
                )
            )
            acc = float(rnd.random() < 0.5)
            rewards.append(
                TrajectoryReward(
                    trajectory_id=f"g{gi}t{i}",
                    total=acc,
                    components={
                        "accuracy": acc,
                        "format_stream": float(rnd.random() < 0.8),
                        "format_deep": float(rnd.random() < 0.9),
                        "length_stream": -rnd.random() * 4,
                        "length_deep": -rnd.random() * 4,
                        "efficiency": acc * rnd.random(),
                    },
                )
            )
        groups.append(Group(id=f"g{gi}", mode="streaming", trajectories=trajs))
        results.append(RewardResult(group_id=f"g{gi}", rewards=rewards))
    return groups, results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--g", type=int, default=8)
    p.add_argument("--len", type=int, default=96)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--token-budget", type=int, default=8192)
    p.add_argument(
        "--ranks", type=int, help="> 1: also compare 1 process with N ranks (CPU); with --size: fsdp's (2)"
    )
    p.add_argument(
        "--sharding", default="replicate", help="with --ranks: layouts to compare, e.g. replicate,fsdp"
    )
    p.add_argument("--size", choices=list(SIZES), help="a random-weight Llama of this size (not --model)")
    p.add_argument("--variants", default="full,lora,fsdp", help="with --size: of full, lora, fsdp")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), default="auto")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--packing", action="store_true", help="padded vs packed on a batch of mixed lengths")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument(
        "--row-mask", action="store_true", help="with --packing: also the packed learner with sdpa's row mask"
    )
    p.add_argument(
        "--compile",
        choices=("inductor", "aot_eager", "eager"),
        help="with --packing: also the packed learner with its decoder layers torch.compiled by this backend",
    )
    args = p.parse_args()
    configure_process()
    if args.packing:
        compare_packing(args)
        return
    if args.size:
        args.ranks = args.ranks or 2
        if args.ranks < 2:
            raise SystemExit("--ranks: fsdp shards over 2 or more ranks")
        compare_variants(args)
        return
    args.ranks = args.ranks or 1
    import torch

    from learner.config import LearnerSettings
    from learner.train import Learner, resolve_model_path

    path = resolve_model_path(args.model)
    if not (path / "config.json").exists():
        raise SystemExit(f"no model at {path}")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    groups, rewards = make_batch(args.groups, args.g, args.len, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        learners = {
            est: Learner(
                LearnerSettings(
                    model=path, store=Path(tmp) / est, device=args.device, token_budget=args.token_budget
                )
            )
            for est in ("grpo", "hrpo")
        }
        times: dict[str, list[float]] = {"grpo": [], "hrpo": []}
        walls: dict[str, list[float]] = {"grpo": [], "hrpo": []}
        tps: dict[str, list[float]] = {"grpo": [], "hrpo": []}
        seq_tokens = 0.0
        for step in range(args.steps + 1):  # step 0 is warm-up
            for est in ("grpo", "hrpo") if step % 2 == 0 else ("hrpo", "grpo"):
                batch = TrainBatch(step=step, groups=groups, rewards=rewards, estimator=est)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = learners[est].train_step(batch)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
                if step > 0:
                    times[est].append(res.metrics["train_seconds"])
                    walls[est].append(wall)
                    tps[est].append(res.metrics["tokens_per_s"])
                seq_tokens = res.metrics["seq_tokens"]
    device = args.device
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name()})"
    print(f"model={path.name} device={device} torch_threads={torch.get_num_threads()}")
    print(
        f"batch: {args.groups} groups x {args.g} trajectories, {int(seq_tokens)} tokens (prompt+completion)"
    )
    for est in ("grpo", "hrpo"):
        print(
            f"{est:5s} step (median of {args.steps}): train {statistics.median(times[est]) * 1000:8.1f} ms  "
            f"with publish {statistics.median(walls[est]) * 1000:8.1f} ms  "
            f"tokens/s {statistics.median(tps[est]):9.0f}"
        )
    ratio = statistics.median(times["hrpo"]) / statistics.median(times["grpo"])
    print(f"HRPO / GRPO train-step time ratio: {ratio:.3f} (target <= 1.10)")
    if args.ranks > 1:
        for sharding in args.sharding.split(","):
            compare_ranks(path, groups, rewards, args, sharding.strip())


def _local_bytes(t: Any) -> int:
    """The bytes of ``t`` in this process (its shard when it is an FSDP DTensor)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    return int(local.numel() * local.element_size())


def optimizer_bytes(learner: Any) -> int:
    import torch

    return sum(
        _local_bytes(v)
        for state in learner.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def held_bytes(learner: Any) -> int:
    """Parameter + optimizer-state bytes this process holds for ``learner`` (its shards under FSDP)."""
    return sum(_local_bytes(p) for p in learner.model.parameters()) + optimizer_bytes(learner)


def trained_bytes(learner: Any) -> int:
    """Trainable-parameter + optimizer-state bytes: what full fine-tuning pays for and LoRA does not."""
    trainable = sum(_local_bytes(p) for p in learner.model.parameters() if p.requires_grad)
    return trainable + optimizer_bytes(learner)


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def compare_ranks(
    path: Path, groups: list[Group], rewards: list[RewardResult], args: argparse.Namespace, sharding: str
) -> None:
    """GRPO steps on 1 process (1 thread, N threads) and on N ranks (1 thread each), interleaved."""
    import os

    import torch

    from learner.config import LearnerSettings
    from learner.distributed import STOP, Ranks, free_port
    from learner.helper_rank import start_helpers
    from learner.train import Learner

    n = args.ranks
    tps: dict[str, list[float]] = {}
    held: dict[str, int] = {}
    rss = 0
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["OMP_NUM_THREADS"] = "1"
        port = free_port()
        cfg: dict[str, Any] = {"device": args.device, "token_budget": args.token_budget}
        rank_cfg = LearnerSettings(model=path, store=root / "ranks", sharding=sharding, **cfg)  # type: ignore[arg-type]
        helpers = start_helpers(n, "127.0.0.1", port, rank_cfg)
        ranks = Ranks.init(0, n, "127.0.0.1", port, "nccl" if args.device.startswith("cuda") else "gloo")
        try:
            learners = {
                "1 process, 1 thread": (Learner(LearnerSettings(model=path, store=root / "a", **cfg)), 1),
                f"1 process, {n} threads": (Learner(LearnerSettings(model=path, store=root / "b", **cfg)), n),
                f"{n} ranks {sharding}": (Learner(rank_cfg, ranks=ranks), 1),
            }
            for step in range(args.steps + 1):  # step 0 is warm-up
                order = list(learners) if step % 2 == 0 else list(reversed(learners))
                for name in order:
                    learner, threads = learners[name]
                    torch.set_num_threads(threads)
                    res = learner.train_step(TrainBatch(step=step, groups=groups, rewards=rewards))
                    if step > 0:
                        tps.setdefault(name, []).append(res.metrics["tokens_per_s"])
            held = {name: held_bytes(learner) for name, (learner, _) in learners.items()}
            rss = peak_rss(helpers[0].pid)
            ranks.broadcast(STOP)
        finally:
            ranks.close()
            for h in helpers:
                h.wait(timeout=60)
    print(
        f"cores: {os.cpu_count()}  sharding: {sharding}  (GRPO step, median of {args.steps}, ranks "
        f"interleaved with 1 process; held: parameters + AdamW state in this process / on rank 0)"
    )
    base = statistics.median(tps["1 process, 1 thread"])
    for name in held:  # the learners' order
        med = statistics.median(tps[name])
        print(
            f"{name:24s} tokens/s {med:9.0f}  ({med / base:.2f}x the 1-thread process)  "
            f"held {held[name] / 2**20:8.2f} MiB"
        )
    print(f"rank 1 peak RSS: {rss / 2**20:.0f} MiB")


@dataclass(frozen=True)
class Size:
    """A Llama shape; the name in ``SIZES`` is its parameter count, rounded."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SIZES = {
    # ~10 M with a small vocabulary: the head is ~13 % of the matmul work, as at 1 B (TinyLlama: ~6 %),
    # not the ~40 % a 12k-32k vocabulary would make it at this width
    "10m": Size(hidden=256, layers=8, heads=8, kv_heads=8, intermediate=768, vocab=4096),
    "2m": Size(hidden=128, layers=4, heads=4, kv_heads=4, intermediate=344, vocab=4096),
    "20m": Size(hidden=384, layers=6, heads=6, kv_heads=6, intermediate=1024, vocab=16000),
    "125m": Size(hidden=768, layers=12, heads=12, kv_heads=12, intermediate=2048, vocab=32000),
    "350m": Size(hidden=1024, layers=24, heads=16, kv_heads=16, intermediate=2816, vocab=32000),
    "1b": Size(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, vocab=32000),  # TinyLlama
}


def build_checkpoint(size: Size, out: Path, seed: int = 0) -> int:
    """A ``LlamaForCausalLM`` of ``size`` with seeded random weights, saved to ``out`` as an HF checkpoint
    (the Learner reads the config and weights only; no tokenizer). Returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        intermediate_size=size.intermediate,
        vocab_size=size.vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


@dataclass
class VariantRow:
    name: str
    trainable: int = 0  # parameters with a gradient (this rank's shard under FSDP)
    step_s: float = 0.0  # median train step (publishing excluded)
    tokens_per_s: float = 0.0
    trained_bytes: int = 0  # trainable parameters + AdamW state, this process
    held_bytes: int = 0  # all parameters + AdamW state, this process
    peak_bytes: int = 0
    note: str = ""


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak(device: Any) -> int:
    """Frees the last variant and resets the peak counter; returns the baseline the peak is measured from."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return 0
    try:  # return freed heap to the OS, then restart VmHWM from the current RSS (Linux)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _rss("VmRSS")


def _peak(device: Any, baseline: int) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _rss("VmHWM") - baseline


def run_variant(
    learner: Any, groups: list[Group], rewards: list[RewardResult], steps: int, row: VariantRow
) -> None:
    """Warm-up + ``steps`` GRPO steps on ``learner``; the medians and what it holds into ``row``."""
    times, tps = [], []
    for step in range(steps + 1):  # step 0 is warm-up
        res = learner.train_step(TrainBatch(step=step, groups=groups, rewards=rewards))
        if step > 0:
            times.append(res.metrics["train_seconds"])
            tps.append(res.metrics["tokens_per_s"])
    row.step_s, row.tokens_per_s = statistics.median(times), statistics.median(tps)
    row.trainable = sum(
        _local_bytes(p) // p.element_size() for p in learner.model.parameters() if p.requires_grad
    )
    row.trained_bytes, row.held_bytes = trained_bytes(learner), held_bytes(learner)


def compare_variants(args: argparse.Namespace) -> None:
    """``--size``: full fine-tuning vs LoRA vs FSDP on one random-weight model and one batch."""
    import os

    import torch

    from learner.config import LearnerSettings
    from learner.distributed import STOP, Ranks, free_port
    from learner.helper_rank import start_helpers
    from learner.train import Learner

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := set(variants) - {"full", "lora", "fsdp"}:
        raise SystemExit(f"unknown variants {sorted(unknown)}: use full, lora, fsdp")
    size = SIZES[args.size]
    on_cuda = args.device.startswith("cuda")
    if "lora" in variants:
        import peft  # noqa: F401  (imported before the variants: its import is not a variant's memory)
    rows: list[VariantRow] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / f"llama-{args.size}"
        n_params = build_checkpoint(size, path, args.seed)
        groups, rewards = make_batch(args.groups, args.g, args.len, size.vocab, args.seed)
        seq_tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for g in groups for t in g.trajectories)

        def config(name: str) -> LearnerSettings:
            return LearnerSettings(
                model=path,
                store=root / name,
                # ranks on CUDA: "cuda" is cuda:<rank> on each rank (a "cuda:0" would put all on one)
                device="cuda" if on_cuda and name == "fsdp" else args.device,
                token_budget=args.token_budget,
                mixed_precision=args.mixed_precision,
                activation_checkpointing=args.activation_checkpointing,
                lora_rank=args.lora_rank if name == "lora" else 0,
                sharding="fsdp" if name == "fsdp" else "replicate",
                save_optimizer=False,  # publishing is outside the step time; keep the disk small
                keep_versions=1,
            )

        for name in variants:
            row = VariantRow(name if name != "fsdp" else f"fsdp x{args.ranks}")
            rows.append(row)
            if name != "fsdp":
                baseline = _reset_peak(torch.device(args.device))
                learner = Learner(config(name))
                run_variant(learner, groups, rewards, args.steps, row)
                row.peak_bytes = _peak(learner.device, baseline)
                del learner
                continue
            if on_cuda and torch.cuda.device_count() < args.ranks:
                row.note = (
                    f"needs >= {args.ranks} GPUs (NCCL: one GPU per rank), {torch.cuda.device_count()} here"
                )
                continue
            os.environ["OMP_NUM_THREADS"] = "1"
            port = free_port()
            rank_cfg = config(name)
            helpers = start_helpers(args.ranks, "127.0.0.1", port, rank_cfg)
            ranks = Ranks.init(0, args.ranks, "127.0.0.1", port, "nccl" if on_cuda else "gloo")
            try:
                device = torch.device("cuda:0" if on_cuda else "cpu")
                baseline = _reset_peak(device)
                learner = Learner(rank_cfg, ranks=ranks)
                run_variant(learner, groups, rewards, args.steps, row)
                row.peak_bytes = _peak(device, baseline)
                del learner
                ranks.broadcast(STOP)
            finally:
                ranks.close()
                for h in helpers:
                    h.wait(timeout=120)
    print_variants(args, n_params, seq_tokens, rows)


def print_variants(args: argparse.Namespace, n_params: int, seq_tokens: int, rows: list[VariantRow]) -> None:
    import torch

    size = SIZES[args.size]
    device = args.device
    if device.startswith("cuda"):
        device += f" ({torch.cuda.get_device_name()})"
    peak = "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "peak RSS growth (VmHWM)"
    print(
        f"model=llama-{args.size} ({n_params / 1e6:.1f} M parameters: hidden {size.hidden}, "
        f"{size.layers} layers, {size.heads} heads ({size.kv_heads} kv), "
        f"intermediate {size.intermediate}, vocab {size.vocab}; "
        f"random weights, seed {args.seed})"
    )
    print(
        f"device={device} torch_threads={torch.get_num_threads()} mixed_precision={args.mixed_precision} "
        f"activation_checkpointing={args.activation_checkpointing} lora_rank={args.lora_rank}"
    )
    print(
        f"batch: {args.groups} groups x {args.g} trajectories, {seq_tokens} tokens (prompt+completion), "
        f"GRPO; median of {args.steps} steps after a warm-up, publishing excluded"
    )
    print(
        "trainable + AdamW: trainable parameters + AdamW state; held: all parameters + AdamW state; both "
        f"in this process (rank 0's shards for fsdp); peak: {peak} from before the model is loaded"
    )
    print(
        "| variant | trainable params (this process) | step s | tokens/s | trainable + AdamW MiB | held MiB "
        "| peak MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r.note:
            print(f"| {r.name} | {r.note} | | | | | |")
            continue
        print(
            f"| {r.name} | {r.trainable / 1e6:.2f} M | {r.step_s:.3f} | {r.tokens_per_s:.0f} | "
            f"{r.trained_bytes / 2**20:.1f} | {r.held_bytes / 2**20:.1f} | {r.peak_bytes / 2**20:.0f} |"
        )


def make_mixed_batch(
    n_groups: int, g: int, min_len: int, max_len: int, vocab: int, seed: int = 0
) -> tuple[list[Group], list[RewardResult]]:
    """GRPO groups whose trajectories are ``min_len`` to ``max_len`` prompt+completion tokens (uniform),
    prompts of 4 to 12 tokens, behaviour log-probs, half of each group correct."""
    rnd = random.Random(seed)
    groups, results = [], []
    for gi in range(n_groups):
        trajs, rewards = [], []
        for i in range(g):
            n = rnd.randint(min_len, max_len)
            n_prompt = min(rnd.randint(4, 12), n - 1)
            trajs.append(
                Trajectory(
                    id=f"g{gi}t{i}",
                    group_id=f"g{gi}",
                    prompt_ids=[rnd.randrange(3, vocab) for _ in range(n_prompt)],
                    completion_ids=[rnd.randrange(3, vocab) for _ in range(n - n_prompt)],
                    logprobs=[-rnd.random() * 3 for _ in range(n - n_prompt)],
                )
            )
            rewards.append(TrajectoryReward(trajectory_id=f"g{gi}t{i}", total=float(i % 2)))
        groups.append(Group(id=f"g{gi}", trajectories=trajs))
        results.append(RewardResult(group_id=f"g{gi}", rewards=rewards))
    return groups, results


def computed_tokens(lengths: list[int], token_budget: int, packing: bool) -> int:
    """The tokens the model computes: per micro-batch, rows x the widest row (learner/logprobs.py plan)."""
    from learner import logprobs as lp

    return sum(
        len(mb) * max(sum(lengths[i] for i in row) for row in mb)
        for mb in lp.plan(lengths, token_budget, packing=packing)
    )


PACKING_SIDES = {
    "padded (before issue 37)": {"packing": False, "logprob_chunk": 0},
    # the defaults: attention per trajectory, the fused head keeping its logits within 256 MiB
    "packed + chunked head": {"packing": True, "logprob_chunk": 4096},
}
# --row-mask: the first packed learner of issue 37 too (sdpa with the row's block mask, logits recomputed)
ROW_MASK_SIDE = {"packing": True, "logprob_chunk": 4096, "segment_attention": False, "logprob_keep_mib": 0}
PACKED = "packed + chunked head"


def packed_logprobs(learner: Any, trajectories: list[Trajectory]) -> Any:
    """The completion log-probs (0 where no token) the learner's step computes, with autograd on (the
    graphs a compiled learner trains with), flattened over its micro-batches."""
    import torch

    from learner import logprobs as lp

    outs = lp.recompute(learner.model, trajectories, **learner.layout())
    return torch.cat([(o.logp * o.valid).detach().flatten() for o in outs])


def compiled_graphs() -> int:
    """The graphs torch.compile has compiled in this process so far (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def max_weight_diff(a: Any, b: Any) -> float:
    """The largest |difference| between two learners' parameters."""
    pb = dict(b.model.named_parameters())
    return max(float((p.detach() - pb[n].detach()).abs().max()) for n, p in a.model.named_parameters())


def compare_packing(args: argparse.Namespace) -> None:
    """``--packing``: the padded and the packed learner on one batch of mixed lengths, interleaved."""
    import os

    import torch

    from learner.config import LearnerSettings
    from learner.train import Learner

    size = SIZES[args.size or "10m"]
    sides = dict(PACKING_SIDES)
    if args.row_mask:
        sides["packed, row mask, logits recomputed"] = ROW_MASK_SIDE
    compiled = f"packed + {args.compile}" if args.compile else None
    if compiled:
        sides[compiled] = {**PACKING_SIDES[PACKED], "torch_compile": args.compile}
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = root / "llama"
        n_params = build_checkpoint(size, path, args.seed)
        groups, rewards = make_mixed_batch(
            args.groups, args.g, args.min_len, args.max_len, size.vocab, args.seed
        )
        lengths = [len(t.prompt_ids) + len(t.completion_ids) for g in groups for t in g.trajectories]
        learners = {
            name: Learner(
                LearnerSettings(
                    model=path,
                    store=root / str(k),
                    device=args.device,
                    token_budget=args.token_budget,
                    mixed_precision=args.mixed_precision,
                    save_optimizer=False,
                    keep_versions=1,
                    **kw,  # type: ignore[arg-type]
                )
            )
            for k, (name, kw) in enumerate(sides.items())
        }
        tps: dict[str, list[float]] = {name: [] for name in learners}
        secs: dict[str, list[float]] = {name: [] for name in learners}
        cpu: dict[str, list[float]] = {name: [] for name in learners}
        warm: dict[str, float] = {name: 0.0 for name in learners}  # equality forward + warm-up step, s
        loss0: dict[str, float] = {}
        same: list[str] = []
        if compiled:  # the same computation? both from the same checkpoint, before any step
            trajs = [t for g in groups for t in g.trajectories]
            logps = {}
            for name in (PACKED, compiled):
                t0 = time.perf_counter()
                logps[name] = packed_logprobs(learners[name], trajs)
                warm[name] += time.perf_counter() - t0
            diff = float((logps[PACKED] - logps[compiled]).abs().max())
            same.append(f"completion log-probs before any step: max |diff| {diff:.2e}")
        graphs = 0
        for step in range(args.steps + 1):  # step 0 is warm-up
            if step == 1:
                graphs = compiled_graphs()
            for name in list(learners) if step % 2 == 0 else list(reversed(learners)):
                c0, t0 = time.process_time(), time.perf_counter()  # CPU: one torch thread, less load-bound
                res = learners[name].train_step(TrainBatch(step=step, groups=groups, rewards=rewards))
                if step > 0:
                    cpu[name].append(time.process_time() - c0)
                    tps[name].append(res.metrics["tokens_per_s"])
                    secs[name].append(res.metrics["train_seconds"])
                else:
                    warm[name] += time.perf_counter() - t0
                    loss0[name] = res.metrics["loss"]
            if step == 0 and compiled:
                same.append(f"warm-up step loss: max |diff| {abs(loss0[PACKED] - loss0[compiled]):.2e}")
                moved = max_weight_diff(learners[PACKED], learners[compiled])
                same.append(f"weights after it: max |diff| {moved:.2e}")
        if compiled:  # dynamic shapes: the timed steps should run the warm-up's graphs
            during = compiled_graphs() - graphs
            same.append(f"graphs compiled: {graphs} before the timed steps, {during} during them")
    real = sum(lengths)
    print(
        f"model=llama-{args.size or '10m'} ({n_params / 1e6:.1f} M parameters: hidden {size.hidden}, "
        f"{size.layers} layers, vocab {size.vocab}; random weights, seed {args.seed}) device={args.device} "
        f"torch_threads={torch.get_num_threads()} load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"batch: {args.groups} groups x {args.g} trajectories of {args.min_len}-{args.max_len} tokens, "
        f"{real} real tokens, GRPO, token_budget {args.token_budget}; median of {args.steps} steps after a "
        "warm-up, sides alternating, publishing excluded"
    )
    print(
        "| learner | micro-batches | computed tokens | computed / real | step s | tokens/s | vs padded "
        "| step CPU s (with publish) | vs padded (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    base = statistics.median(tps[next(iter(tps))])
    base_cpu = statistics.median(cpu[next(iter(cpu))])
    for name, kw in sides.items():
        from learner import logprobs as lp

        n_mb = len(lp.plan(lengths, args.token_budget, packing=bool(kw["packing"])))
        comp = computed_tokens(lengths, args.token_budget, bool(kw["packing"]))
        med = statistics.median(tps[name])
        print(
            f"| {name} | {n_mb} | {comp} | {comp / real:.3f} | {statistics.median(secs[name]):.2f} | "
            f"{med:.0f} | {med / base:.2f}x | {statistics.median(cpu[name]):.2f} | "
            f"{base_cpu / statistics.median(cpu[name]):.2f}x |"
        )
    print(
        "warm-up (compilation included: the equality forward and the warm-up step), s: "
        + ", ".join(f"{name} {w:.1f}" for name, w in warm.items())
    )
    if compiled:
        print(f"{compiled} vs {PACKED} on the same weights: " + "; ".join(same))


if __name__ == "__main__":
    main()
