"""A demo step's code reward in the sandbox: one run per test against one run per program.

``.venv/bin/python bench/code_batch.py --items 64 --rounds 2``: the code model's problems
(zoo/code/tasks.py, 4 assert tests each) with their reference solutions, planned by
``reward_svc.code.plan_runs`` both ways (each program's tests as 4 runs; as one run of the driver
that forks a process per test) and run on one warm pool, the two legs alternated; prints seconds a
batch for each and their ratio, and checks both give every item 4 of 4.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from loom.contracts.rewards import CodeParams
from reward_svc import code
from sandbox_svc.pool import SandboxPool
from zoo.code.tasks import code_problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=64, help="programs a batch (a demo step: 64)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slots", type=int, default=2)
    args = ap.parse_args()
    problems = code_problems(args.items, seed=0, split="train")
    params = CodeParams()
    texts = [f"```python\n{p.solution}\n```" for p in problems]
    tests = [code.read_tests(p.label) for p in problems]
    legs: dict[str, list[list]] = {"one run per test": [], "one run per program": []}
    for t, text in zip(tests, texts, strict=True):
        assert isinstance(t, code.CodeTests)
        batched = code.plan_runs(t, text, params)
        assert isinstance(batched, list) and len(batched) == 1
        lines = [f"\n\n{a}\n" for a in t.asserts or []]
        prog = code.extract_program(text)
        assert prog is not None
        each = code.Limits(cpu_s=5, wall_s=10, memory_mb=params.memory_mb, output_bytes=params.output_bytes)
        single = [code.RunRequest(code=prog[1] + c, limits=each) for c in lines]
        legs["one run per test"].append(single)
        legs["one run per program"].append(batched)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}, {args.slots} slots, {args.items} programs x 4 tests")  # fmt: skip
    secs: dict[str, list[float]] = {k: [] for k in legs}
    with SandboxPool(args.slots, queue_size=4 * args.items) as pool:
        for _ in range(args.rounds):
            for name, plans in legs.items():
                flat = [r for runs in plans for r in runs]
                t0 = time.perf_counter()
                results = pool.run_batch(flat)
                secs[name].append(time.perf_counter() - t0)
                k = 0
                for t, runs in zip(tests, plans, strict=True):
                    assert isinstance(t, code.CodeTests)
                    verdict = code.judge(t, results[k : k + len(runs)])
                    k += len(runs)
                    assert verdict.passed == 1.0, (name, verdict)
    per = {k: statistics.median(v) for k, v in secs.items()}
    for name, s in per.items():
        print(f"| {name} | {s:.2f} s a batch | {args.items / s:.1f} programs/s |")
    print(f"ratio (per test / per program): {per['one run per test'] / per['one run per program']:.2f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
