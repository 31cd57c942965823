"""Reward-service benchmark: ratios measured side by side in one run, printed as a table.

1. HTTP (``uvicorn reward_svc.api:app``) and queue (``reward.score_group`` on the broker) overhead
   vs in-process scoring with the same pool size and settings, for batches of 1, 16 and 256, the three
   paths interleaved batch by batch (target <= 15 % at 256). Run first: a pool forked by a process
   that has verified items itself inherits its warm sympy / math-verify caches, which made the
   in-process path look faster than a fresh service before this order was fixed.
2. Throughput of the verifier pool with W workers vs W x the in-process single-core rate of the same
   checker (gold cache and guards) on the same realistic mix (target >= 0.8), in A/B rounds (this
   VM's speed drifts by tens of per cent within seconds: one long leg each read anywhere from 0.68
   to 0.93), with the machine's own ceiling for W CPU-bound processes printed beside it.
3. The hostile corpus: every item within its deadline + 1 s with status timeout/parse_error, and the
   batch's normal items scored right.
4. Fairness (docs/security-workers.md): 4 hostile items of one request at ``--fair-deadline`` (20 s),
   then 3 normal requests 1 s later, each timed from its own submission; and 2 hostile items of one
   request: the batch's wall time over one item's time (1.0: side by side; 2.0: one after the other).

    .venv/bin/python bench/reward.py [--workers 2] [--items 400] [--broker amqp://guest:guest@127.0.0.1:5672//]
        [--sections 1,2,3,4]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("SYMPY_GROUND_TYPES", "python")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.reward_settings import get_reward_settings  # noqa: E402
from loom.contracts.wire import Group, RewardSpec, Trajectory  # noqa: E402
from reward_svc.core import score_group  # noqa: E402
from reward_svc.corpus import hostile, realistic_mix  # noqa: E402
from reward_svc.mathverify import Checker, MathItem, install_guards  # noqa: E402
from reward_svc.pool import VerifierPool  # noqa: E402
from reward_svc.trace import answer_region  # noqa: E402


def items_of(mix: list[tuple[str, str, bool]]) -> list[MathItem]:
    out = []
    for gold, response, _ in mix:
        kind, region = answer_region(response)
        out.append(MathItem(gold, kind, region))
    return out


def throughput(workers: int, n: int, rounds: int = 6) -> tuple[float, float, list[float], float]:
    """Items/s of the pool and of one core in this process, ``rounds`` A/B rounds of the same ``n``
    items (the machine's drift hits both legs of a round alike; the per-round ratios are returned),
    and the pool's parent CPU seconds per item (its scheduler thread: one thread dispatches every
    item, so ``1 / (that)`` bounds the pool's items/s at any W; issue 37).
    The pool is forked before this process verifies anything: a worker forked after it had verified
    items in-process would inherit its warm sympy / math-verify caches and look faster than it is."""
    items = items_of(realistic_mix(n, seed=7))
    s = get_reward_settings()
    t_pool = t_single = cpu_pool = 0.0
    ratios: list[float] = []
    with VerifierPool(
        workers, max_items=s.max_items_per_worker, max_rss_growth_mb=s.max_rss_growth_mb
    ) as pool:
        pool.check_many(items[: workers * 4], 5)  # fork and warm every worker
        # the checker a pool worker runs (gold cache and guards included), here, on one core
        install_guards()
        checker = Checker()
        checker.check(items[0], 5)
        checker.gold_cache.clear()
        for _ in range(rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            pool.check_many(items, 5)
            tp = time.perf_counter() - t0
            cpu_pool += time.process_time() - c0  # the scheduler thread; the main thread only waits
            t0 = time.perf_counter()
            for it in items:
                checker.check(it, 5)
            ts = time.perf_counter() - t0
            t_pool, t_single = t_pool + tp, t_single + ts
            ratios.append(ts / (workers * tp))
    return rounds * n / t_single, rounds * n / t_pool, ratios, cpu_pool / (rounds * n)


def group_of(mix: list[tuple[str, str, bool]], gid: str) -> Group:
    label = mix[0][0]
    trajs = [Trajectory(id=f"t{i}", group_id=gid, text=r) for i, (_, r, _) in enumerate(mix)]
    return Group(id=gid, label=label, trajectories=trajs)


def batches(size: int, reps: int) -> list[Group]:
    out = []
    for r in range(reps):
        mix = [m for m in realistic_mix(size * 4, seed=100 + r)]
        gold = mix[0][0]
        same = [m for m in mix if m[0] == gold][:size]
        while len(same) < size:
            same.append(same[len(same) % max(1, len(same))])
        out.append(group_of(same, f"b{size}-{r}-{uuid.uuid4().hex[:6]}"))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("reward service did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def overhead(workers: int, sizes: list[int], reps: int, broker: str | None) -> list[tuple[float, ...]]:
    """The three paths run the same batch one after the other (in-process, HTTP, queue), batch after
    batch, so machine noise and per-batch difficulty hit them alike; each path has its own pool of
    ``workers`` verifier processes with the service's settings (recycling included)."""
    import httpx

    spec = RewardSpec()
    data = {s: batches(s, reps + 1) for s in sizes}  # the first batch of each size warms every path
    # wall: in-process, HTTP, queue; then the reward core's own time inside each path (score_s)
    totals: dict[int, list[float]] = {s: [0.0] * 6 for s in sizes}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(
        LOOM_REWARD_WORKERS=str(workers),
        LOOM_TORCH_THREADS="1",
        LOOM_DATA_DIR=f"/tmp/loom-bench-{os.getpid()}",
    )
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "reward_svc.api:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    worker: subprocess.Popen[bytes] | None = None
    app = None
    s = get_reward_settings()  # the pool the service builds: same recycling, same limits
    try:
        if broker:
            qenv = dict(
                env,
                LOOM_BROKER_URL=broker,
                LOOM_RESULT_BACKEND="redis://127.0.0.1:6379/3",
                LOOM_QUEUE_NAMESPACE=f"loombench-{uuid.uuid4().hex[:6]}-",
            )
            worker = subprocess.Popen(
                [sys.executable, "-m", "launch.cli", "worker", "reward", "-c", "1"],
                cwd=REPO,
                env=qenv,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            os.environ.update({k: v for k, v in qenv.items() if k.startswith("LOOM_")})
            from loom.contracts.settings import get_settings
            from loom.queue import make_celery

            get_settings.cache_clear()
            app = make_celery("reward", get_settings())
        url = f"http://127.0.0.1:{port}"
        wait_http(url)
        body = lambda g: {"groups": [g.model_dump(mode="json")], "spec": spec.model_dump(mode="json")}  # noqa: E731
        with (
            VerifierPool(
                workers,
                max_items=s.max_items_per_worker,
                max_rss_growth_mb=s.max_rss_growth_mb,
                mem_limit_mb=s.mem_limit_mb,
            ) as pool,
            httpx.Client(base_url=url, timeout=300) as c,
        ):
            from reward_svc.tasks import submit_group

            for size in sizes:
                for k, g in enumerate(data[size]):
                    t0 = time.perf_counter()
                    r_in = score_group(g, spec, pool.check_many)
                    t_in = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    resp = c.post("/v1/rewards", json=body(g))
                    t_http = time.perf_counter() - t0
                    resp.raise_for_status()
                    s_http = resp.json()["results"][0]["score_s"]
                    t_q = s_q = 0.0
                    if app is not None:
                        qid = g.id + "-q"  # a fresh task id: the queue path must really score it
                        g2 = Group.model_validate(
                            {
                                **g.model_dump(),
                                "id": qid,
                                "trajectories": [{**t.model_dump(), "group_id": qid} for t in g.trajectories],
                            }
                        )
                        t0 = time.perf_counter()
                        s_q = submit_group(g2, spec, app=app).get(timeout=300)["score_s"]
                        t_q = time.perf_counter() - t0
                    if k > 0:
                        row = (t_in, t_http, t_q, r_in.score_s or 0.0, s_http, s_q)
                        for i, dt in enumerate(row):
                            totals[size][i] += dt
                        if os.environ.get("LOOM_BENCH_VERBOSE"):
                            print(f"   {size:>4} " + " ".join(f"{x:.3f}" for x in row))
    finally:
        if app is not None:
            app.close()
        if worker is not None:
            stop(worker)
        stop(server)
    return [(size, *(x / reps for x in totals[size])) for size in sizes]


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x = (x * 31 + i) % 1_000_003


def cpu_ceiling(workers: int, n: int = 3_000_000) -> float:
    """What this machine gives ``workers`` CPU-bound processes at once, as a fraction of W x one alone:
    (time of one process alone) / (time of W processes doing the same work each, together). Shared or
    hyper-threaded vCPUs and background load give less than 1; no pool of W processes can beat it."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")

    def timed(k: int) -> float:
        procs = [ctx.Process(target=_spin, args=(n,)) for _ in range(k)]
        t0 = time.perf_counter()
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        return time.perf_counter() - t0

    one = min(timed(1) for _ in range(2))
    many = min(timed(workers) for _ in range(2))
    return one / many


def hostile_run(workers: int, deadline: int) -> list[tuple[str, str, float]]:
    corpus = hostile()
    normal = realistic_mix(16, seed=3)
    items = [MathItem("42", *answer_region(r)) for _, r in corpus] + items_of(normal)
    with VerifierPool(workers, max_items=10_000) as pool:
        verdicts = pool.check_many(items, deadline)
    rows = [(name, v.status, v.seconds) for (name, _), v in zip(corpus, verdicts, strict=False)]
    rest = verdicts[len(corpus) :]
    ok = sum(v.status == "ok" and v.correct == exp for v, (_, _, exp) in zip(rest, normal, strict=True))
    rows.append((f"normal items scored right: {ok}/{len(normal)}", "", max(v.seconds for v in rest)))
    return rows


FAIR_HOSTILE = ["\\boxed{9^{9^{9^{9}}}}", "\\boxed{(10^9)!}", "\\boxed{10^{10^{10}}}", "\\boxed{2^{10^{10}}}"]


def fairness(workers: int, deadline: int) -> tuple[list[float], bool, float, float]:
    """(each normal request's latency, the hostile request still running when they were answered,
    the 2-item batch's wall time, its longest item's time)."""
    import threading

    hostile_items = [MathItem("42", *answer_region(r)) for r in FAIR_HOSTILE]
    normal = realistic_mix(3, seed=11)
    with VerifierPool(workers, max_items=10_000) as pool:
        pool.check_many(items_of(realistic_mix(workers * 4, seed=1)), 5)  # fork and warm every worker
        done = threading.Event()

        def bad() -> None:
            try:
                pool.check_many(hostile_items, deadline)
            except RuntimeError:  # the pool closed under it
                pass
            done.set()

        threading.Thread(target=bad, daemon=True).start()
        time.sleep(1.0)
        latencies: list[float] = []

        def one(case: tuple[str, str, bool]) -> None:
            t0 = time.perf_counter()
            pool.check_many(items_of([case]), 5)
            latencies.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=one, args=(c,)) for c in normal]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        still_running = not done.is_set()
    with VerifierPool(workers, max_items=10_000) as pool:
        pool.check_many(items_of(realistic_mix(workers * 4, seed=1)), 5)
        t0 = time.perf_counter()
        verdicts = pool.check_many(hostile_items[:2], deadline)
        wall = time.perf_counter() - t0
    return latencies, still_running, wall, max(v.seconds for v in verdicts)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--items", type=int, default=800, help="items per throughput round")
    p.add_argument("--rounds", type=int, default=6, help="A/B rounds of the throughput benchmark")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--deadline", type=int, default=3)
    p.add_argument(
        "--broker", default="amqp://guest:guest@127.0.0.1:5672//", help="'' to skip the queue path"
    )
    p.add_argument("--fair-deadline", type=int, default=20)
    p.add_argument("--sections", default="1,2,3,4", help="which of the sections to run")
    a = p.parse_args()
    sections = {int(x) for x in a.sections.split(",") if x}
    if 1 in sections:
        print_overhead(a)
    if 2 in sections:
        print_throughput(a)
    if 3 in sections:
        print_hostile(a)
    if 4 in sections:
        print_fairness(a)


def print_overhead(a: argparse.Namespace) -> None:
    print(f"\n1. overhead, same pool size ({a.workers}) and settings, mean of {a.reps} batches, interleaved")
    print("   transport = wall time - the reward core's own time for that request, measured where it ran")
    print("   (score_s: same process, same pool, same caches); wall vs a separate in-process pool beside it")
    print(
        f"{'batch':>6}{'core s':>9}{'HTTP s':>9}{'HTTP +%':>9}{'core s':>9}{'queue s':>9}{'queue +%':>10}"
        f"{'in-proc s':>11}{'HTTP/in-proc':>14}{'queue/in-proc':>15}"
    )
    for size, t_in, t_http, t_q, _s_in, s_http, s_q in overhead(
        a.workers, [1, 16, 256], a.reps, a.broker or None
    ):
        q = (
            f"{s_q:>9.3f}{t_q:>9.3f}{100 * (t_q - s_q) / s_q:>9.1f}%"
            if a.broker
            else f"{'-':>9}{'-':>9}{'-':>10}"
        )
        print(
            f"{size:>6}{s_http:>9.3f}{t_http:>9.3f}{100 * (t_http - s_http) / s_http:>8.1f}%{q}"
            f"{t_in:>11.3f}{t_http / t_in:>14.2f}{(t_q / t_in if a.broker else 0.0):>15.2f}"
        )


def print_throughput(a: argparse.Namespace) -> None:
    single, pooled, ratios, parent_s = throughput(a.workers, a.items, a.rounds)
    print(
        f"\n2. throughput, {a.rounds} A/B rounds of {a.items} realistic items"
        " (overhead first: this process never verified before)"
    )
    print(f"{'in-process, 1 core':<32}{single:>10.1f} items/s")
    print(f"{f'pool, {a.workers} workers':<32}{pooled:>10.1f} items/s")
    print(f"{'ratio pool / (W x single)':<32}{pooled / (a.workers * single):>10.2f}   (target >= 0.8)")
    print(
        f"{'  median of the rounds':<32}{statistics.median(ratios):>10.2f}"
        f"   (rounds: {' '.join(f'{r:.2f}' for r in ratios)})"
    )
    print(
        f"{'parent CPU per item':<32}{1e6 * parent_s:>10.0f} us"
        f"   (bounds the pool at {1 / parent_s:.0f} items/s whatever W)"
    )
    ceiling = cpu_ceiling(a.workers)
    print(f"{'machine ceiling (pure CPU loop)':<32}{ceiling:>10.2f}   ({a.workers} processes vs W x one)")


def print_hostile(a: argparse.Namespace) -> None:
    print(f"\n3. hostile corpus, deadline {a.deadline} s, {a.workers} workers, 16 normal items in the batch")
    print(f"{'item':<44}{'status':<13}{'seconds':>8}")
    for name, status, sec in hostile_run(a.workers, a.deadline):
        flag = "" if sec <= a.deadline + 1 else "  OVER"
        print(f"{name:<44}{status:<13}{sec:>8.2f}{flag}")


def print_fairness(a: argparse.Namespace) -> None:
    latencies, running, wall, one = fairness(a.workers, a.fair_deadline)
    print(f"\n4. fairness, {a.workers} workers, hostile items at timeout_s={a.fair_deadline}")
    print(
        f"{'3 normal requests 1 s after 4 hostile items':<48}"
        f"{' '.join(f'{x:.2f}' for x in sorted(latencies))} s   (target < 2 s each)"
    )
    print(f"{'  hostile request still running then':<48}{running}")
    print(
        f"{'2 hostile items of one request: wall / one item':<48}{wall / one:.2f}"
        f"   ({wall:.1f} s / {one:.1f} s)"
    )


if __name__ == "__main__":
    main()
