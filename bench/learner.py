"""Learner train-step cost: HRPO vs GRPO on the same batch (ratio), train-step tokens/s, and 1 vs N ranks.

HRPO's three terms share one forward and one backward (AdaSR eq. 10), so its step should cost about
what a GRPO step costs. Both estimators train the SAME streaming batch (stream / observation / deep
segments, HRPO reward components), alternating step by step in one run on fresh copies of the model;
``train_seconds`` is the step without publishing, ``wall`` includes writing the version to the store.

With ``--ranks N`` (N > 1) the same GRPO step also runs on N data-parallel ranks (learner/distributed.py:
this process is rank 0, the others its children, gloo on CPU, one torch thread per rank) alternating
step by step with a one-process learner at one torch thread and at N threads: tokens/s side by side.

    python bench/learner.py [--model tiny|PATH] [--groups 4] [--g 8] [--len 96] [--steps 5] [--device cpu]
                            [--ranks 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
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
    p.add_argument("--ranks", type=int, default=1, help="> 1: also compare 1 process with N ranks (CPU)")
    args = p.parse_args()
    configure_process()
    import torch

    from learner.train import Learner, LearnerConfig, resolve_model_path

    path = resolve_model_path(args.model)
    if not (path / "config.json").exists():
        raise SystemExit(f"no model at {path}")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(path)).vocab_size
    groups, rewards = make_batch(args.groups, args.g, args.len, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        learners = {
            est: Learner(
                LearnerConfig(
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
        compare_ranks(path, groups, rewards, args)


def compare_ranks(
    path: Path, groups: list[Group], rewards: list[RewardResult], args: argparse.Namespace
) -> None:
    """GRPO steps on 1 process (1 thread, N threads) and on N ranks (1 thread each), interleaved."""
    import os

    import torch

    from learner.distributed import STOP, Ranks, free_port, start_helpers
    from learner.train import Learner, LearnerConfig

    n = args.ranks
    tps: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["OMP_NUM_THREADS"] = "1"
        port = free_port()
        cfg: dict[str, Any] = {"device": args.device, "token_budget": args.token_budget}
        rank_cfg = LearnerConfig(model=path, store=root / "ranks", **cfg)
        helpers = start_helpers(n, "127.0.0.1", port, rank_cfg.to_json())
        ranks = Ranks.init(0, n, "127.0.0.1", port, "nccl" if args.device.startswith("cuda") else "gloo")
        try:
            learners = {
                "1 process, 1 thread": (Learner(LearnerConfig(model=path, store=root / "a", **cfg)), 1),
                f"1 process, {n} threads": (Learner(LearnerConfig(model=path, store=root / "b", **cfg)), n),
                f"{n} ranks, 1 thread each": (Learner(rank_cfg, ranks=ranks), 1),
            }
            for step in range(args.steps + 1):  # step 0 is warm-up
                order = list(learners) if step % 2 == 0 else list(reversed(learners))
                for name in order:
                    learner, threads = learners[name]
                    torch.set_num_threads(threads)
                    res = learner.train_step(TrainBatch(step=step, groups=groups, rewards=rewards))
                    if step > 0:
                        tps.setdefault(name, []).append(res.metrics["tokens_per_s"])
            ranks.broadcast(STOP)
        finally:
            ranks.close()
            for h in helpers:
                h.wait(timeout=60)
    print(f"cores: {os.cpu_count()}  (GRPO step, median of {args.steps}, ranks interleaved with 1 process)")
    base = statistics.median(tps["1 process, 1 thread"])
    for name, values in tps.items():
        med = statistics.median(values)
        print(f"{name:24s} tokens/s {med:9.0f}  ({med / base:.2f}x the 1-thread process)")


if __name__ == "__main__":
    main()
