"""One-step off-policy vs synchronous run loop: wall time per step of the SAME run (gateway/runs.py).

SIMULATED STAGE LATENCIES: the stages sleep instead of generating and training (a generation phase
of --gen-s seconds per step, as if the rollout replicas worked the batch in parallel, and a train step
of --train-s seconds), so the benchmark measures the loop's overlap, not a model. The real RunLoop,
GatewayState (SQLite) and metrics code run; only the Stages are simulated.

    python bench/pipeline.py [--steps 8] [--gen-s 0.4] [--train-s 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from gateway.models import RunRequest
from gateway.runs import RunLoop
from gateway.state import GatewayState
from loom.contracts.wire import (
    Group,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    StepResult,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
)


class SimulatedStages:
    def __init__(self, gen_s: float, train_s: float) -> None:
        self.gen_s, self.train_s, self.version = gen_s, train_s, 0

    async def generate(self, key: str, req: RolloutRequest) -> Group:
        await asyncio.sleep(self.gen_s)  # the groups of a step generate concurrently, as on replicas
        trajs = [
            Trajectory(id=f"t{i}", group_id=key, completion_ids=[1] * 16, policy_version=self.version)
            for i in range(req.sampling.n)
        ]
        return Group(id=key, trajectories=trajs)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        rng = random.Random(group.id)
        rws = [
            TrajectoryReward(trajectory_id=t.id, total=float(rng.random() < 0.5)) for t in group.trajectories
        ]
        return RewardResult(group_id=group.id, rewards=rws)

    async def train(self, key: str, batch: TrainBatch) -> StepResult:
        await asyncio.sleep(self.train_s)
        self.version += 1
        return StepResult(step=batch.step, policy_version=self.version)

    def publish_policy(self, key: str, version: int) -> None:
        return None


def run_once(tmp: Path, staleness: int, args: argparse.Namespace) -> tuple[float, list[dict]]:
    state = GatewayState(tmp / f"s{staleness}.sqlite")
    req = RunRequest.model_validate(
        {
            "dataset": {
                "jsonl": "".join(json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(64))
            },
            "sampling": {"n": 4},
            "schedule": {"steps": args.steps, "batch_size": 8, "staleness": staleness},
        }
    )
    run_id, _ = state.runs.create(owner="bench", request=req)
    t0 = time.perf_counter()
    status = asyncio.run(RunLoop(run_id, state, SimulatedStages(args.gen_s, args.train_s), tmp).run())
    wall = time.perf_counter() - t0
    assert status == "succeeded", status
    return wall, state.runs.steps(run_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--gen-s", type=float, default=0.4)
    p.add_argument("--train-s", type=float, default=0.3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        sync, sync_m = run_once(Path(d), 0, args)
        off, off_m = run_once(Path(d), 1, args)
    print(f"SIMULATED stage latencies: generation {args.gen_s} s/step, train {args.train_s} s/step")
    for label, wall, m in [
        ("synchronous (staleness 0)", sync, sync_m),
        ("one-step off-policy (1)", off, off_m),
    ]:
        stale = max(x["staleness"] for x in m)
        print(f"{label:<28} {wall / args.steps:.3f} s/step over {args.steps} steps, max staleness {stale}")
    print(f"off-policy / synchronous wall time per step: {off / sync:.2f}")


if __name__ == "__main__":
    main()
