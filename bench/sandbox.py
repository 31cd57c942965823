"""Sandbox benchmark: ratios measured side by side in one run (docs/benchmarks/sandbox.md).

1. Throughput: the same programs run bare (``subprocess.run`` of ``/usr/bin/python3`` or bash, as
   many at once as the pool has slots) and in the sandbox pool (bubblewrap, rlimits, cgroup, seccomp),
   in A/B rounds; runs/s of each and the ratio (target >= 0.5 with warm slots), for a mix of Python and
   bash (a warm sandbox of the other language is started again) and for Python alone.
2. Start latency: one trivial program at a time, submit to outcome, p50 / p99, bare and sandboxed.
3. Code rewards through the product path (the sandbox app under uvicorn on 127.0.0.1, the reward
   core calling it with ``loom.clients.sandbox``): items/s at 1, 4 and 16 tests per item.
4. The sandbox as a tool: the same Python snippets as cells of interpreter sessions (one session per
   slot, ``sandbox_svc.session``) and as one-shot runs in the pool, as many at once as there are
   slots, side by side; calls/s of each and the ratio.

    .venv/bin/python bench/sandbox.py [--slots 2] [--runs 120] [--items 24] [--only sessions]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.sandbox import RunRequest  # noqa: E402
from loom.contracts.wire import Group, RewardSpec, Trajectory  # noqa: E402

PROGRAMS = [
    RunRequest(code="import sys\nprint(sum(map(int, sys.stdin.read().split())))", stdin="1 2 3 4\n"),
    RunRequest(code="print(sorted(range(1000), key=lambda x: -x)[:3])"),
    RunRequest(language="bash", code="read a b; echo $((a * b))", stdin="6 7\n"),
    RunRequest(code="s = 0\nfor i in range(20000):\n    s += i * i\nprint(s)"),
]
TRIVIAL = RunRequest(code="pass")


def bare(req: RunRequest) -> str:
    argv = (
        ["/usr/bin/python3", "-I", "-B", "-c", req.code]
        if req.language == "python"
        else ["/bin/bash", "-c", req.code]
    )
    return subprocess.run(
        argv, input=req.stdin.encode(), capture_output=True, timeout=30, env={}
    ).stdout.decode()


def rate(fn: object, reqs: list[RunRequest], width: int) -> float:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(width) as ex:
        list(ex.map(fn, reqs))  # type: ignore[arg-type]
    return len(reqs) / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--runs", type=int, default=120, help="programs per leg")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--items", type=int, default=24, help="code-reward items per size")
    ap.add_argument("--only", choices=("sessions",), default=None, help="run section 4 alone")
    args = ap.parse_args()
    if args.only == "sessions":
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.2f}, {args.slots} slots")  # fmt: skip
        sessions(args)
        return
    from sandbox_svc.pool import SandboxPool

    os.environ["LOOM_SANDBOX_SLOTS"] = str(args.slots)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}, {args.slots} slots")  # fmt: skip
    reqs = [PROGRAMS[i % len(PROGRAMS)] for i in range(args.runs)]
    with SandboxPool(args.slots, queue_size=args.runs) as pool:
        assert all(pool.submit(p).result().status == "ok" for p in PROGRAMS), "a bench program failed"
        print("\n## 1. throughput (median of rounds)\n| programs | bare runs/s | sandbox runs/s | ratio |")
        print("|---|---|---|---|")
        python_only = [p for p in reqs if p.language == "python"]
        for name, batch in (("mixed Python and bash", reqs), ("Python only (a reward batch)", python_only)):
            bare_r, box_r = [], []
            for _ in range(args.rounds):
                bare_r.append(rate(bare, batch, args.slots))
                box_r.append(rate(lambda r: pool.submit(r).result(), batch, args.slots))
            b, s = statistics.median(bare_r), statistics.median(box_r)
            print(f"| {name} | {b:.1f} | {s:.1f} | {s / b:.2f} |")
        lat_b, lat_s = [], []
        for _ in range(max(20, args.runs // 2)):
            t0 = time.perf_counter()
            bare(TRIVIAL)
            lat_b.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pool.submit(TRIVIAL).result()
            lat_s.append(time.perf_counter() - t0)
        print("\n## 2. start latency (one at a time)\n| path | p50 ms | p99 ms |\n|---|---|---|")
        for name, xs in (("bare subprocess", lat_b), ("sandbox pool", lat_s)):
            print(f"| {name} | {pct(xs, 0.5) * 1e3:.1f} | {pct(xs, 0.99) * 1e3:.1f} |")
    code_rewards(args)
    sessions(args)


SNIPPETS = [p.code for p in PROGRAMS if p.language == "python" and not p.stdin] + [
    "import json\nprint(json.dumps({'k': list(range(50))})[:20])",
    "print(len([w for w in 'the quick brown fox'.split() if 'o' in w]))",
]


def sessions(args: argparse.Namespace) -> None:
    """Section 4: cells in sessions against one-shot runs of the same snippets, one run each leg."""
    from loom.contracts.sandbox import SessionOpen
    from sandbox_svc.pool import SandboxPool
    from sandbox_svc.session import SessionManager

    calls = [SNIPPETS[i % len(SNIPPETS)] for i in range(args.runs)]
    per = [calls[k :: args.slots] for k in range(args.slots)]
    with SandboxPool(args.slots, queue_size=args.runs) as pool, SessionManager(args.slots) as manager:
        ids = [manager.open(SessionOpen()).id for _ in range(args.slots)]
        assert all(manager.call(i, SNIPPETS[0]).status == "ok" for i in ids), "a session did not start"
        assert all(pool.submit(RunRequest(code=c)).result().status == "ok" for c in SNIPPETS)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.slots) as ex:
            oneshot = list(ex.map(lambda c: pool.submit(RunRequest(code=c)).result(), calls))
        shot_rate = len(calls) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.slots) as ex:
            cells = list(ex.map(lambda k: [manager.call(ids[k], c) for c in per[k]], range(args.slots)))
        cell_rate = len(calls) / (time.perf_counter() - t0)
    assert all(r.status == "ok" for r in oneshot) and all(r.status == "ok" for rs in cells for r in rs)
    assert [r.stdout for r in oneshot][: args.slots] == [rs[0].stdout for rs in cells][: args.slots]
    print(f"\n## 4. the sandbox as a tool ({len(calls)} snippets, {args.slots} at once)")
    print("| path | calls/s |\n|---|---|")
    print(f"| one-shot runs (warm pool) | {shot_rate:.1f} |\n| session cells | {cell_rate:.1f} |")
    print(f"\nratio session / one-shot: {cell_rate / shot_rate:.2f}")


def code_rewards(args: argparse.Namespace) -> None:
    import logging

    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)

    from loom.clients.sandbox import SandboxClient
    from reward_svc.core import score_group
    from sandbox_svc import api

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(api.app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    client = SandboxClient(f"http://127.0.0.1:{port}")
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    spec = RewardSpec(components=[{"name": "code_pass"}, {"name": "code_all"}])  # type: ignore[list-item]
    print("\n## 3. code rewards over HTTP (4 samples per group)")
    print("| tests per item | items/s | runs/s |\n|---|---|---|")
    try:
        for n in (1, 4, 16):
            label = json.dumps(
                {"inputs": [f"{i} {i}\n" for i in range(n)], "outputs": [str(2 * i) for i in range(n)]}
            )
            groups = [
                Group(id=f"g{k}", task="code", label=label,
                      trajectories=[Trajectory(id=f"t{j}", group_id=f"g{k}", text=program) for j in range(4)])
                for k in range(max(1, args.items // 4))
            ]  # fmt: skip
            t0 = time.perf_counter()
            with ThreadPoolExecutor(4) as ex:
                results = list(
                    ex.map(lambda g: score_group(g, spec, lambda i, t: [], run_code=client.run_batch), groups)
                )
            dt = time.perf_counter() - t0
            assert all(r.total == 2.0 for res in results for r in res.rewards), "a code reward was wrong"
            items = sum(len(g.trajectories) for g in groups)
            print(f"| {n} | {items / dt:.1f} | {items * n / dt:.1f} |")
    finally:
        server.should_exit = True
        api._close_pool()


if __name__ == "__main__":
    main()
