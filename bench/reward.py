"""Reward-service benchmark: ratios measured side by side in one run, printed as a table.

1. Throughput of the verifier pool with W workers vs W x the in-process single-core math-verify
   rate on the same realistic mix (target >= 0.8).
2. HTTP (``uvicorn reward_svc.api:app``) and queue (``reward.score_group`` on the broker) overhead
   vs in-process scoring with the same pool size, for batches of 1, 16 and 256 (target <= 15 % at 256).
3. The hostile corpus: every item within its deadline + 1 s with status timeout/parse_error, and the
   batch's normal items scored right.

    .venv/bin/python bench/reward.py [--workers 2] [--items 400] [--broker amqp://guest:guest@127.0.0.1:5672//]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("SYMPY_GROUND_TYPES", "python")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.schemas import Group, RewardSpec, Trajectory  # noqa: E402
from reward_svc.config import get_reward_settings  # noqa: E402
from reward_svc.core import score_group  # noqa: E402
from reward_svc.corpus import hostile, realistic_mix  # noqa: E402
from reward_svc.mathverify import Checker, MathItem  # noqa: E402
from reward_svc.pool import VerifierPool  # noqa: E402
from reward_svc.trace import answer_region  # noqa: E402


def items_of(mix: list[tuple[str, str, bool]]) -> list[MathItem]:
    out = []
    for gold, response, _ in mix:
        kind, region = answer_region(response)
        out.append(MathItem(gold, kind, region))
    return out


def throughput(workers: int, n: int) -> tuple[float, float]:
    items = items_of(realistic_mix(n, seed=7))
    s = get_reward_settings()
    # the same checker a pool worker runs (gold cache included), in this process, one core
    checker = Checker()
    checker.check(items[0], 5)  # warm imports
    checker.gold_cache.clear()
    t0 = time.perf_counter()
    for it in items:
        checker.check(it, 5)
    single = n / (time.perf_counter() - t0)
    with VerifierPool(
        workers, max_items=s.max_items_per_worker, max_rss_growth_mb=s.max_rss_growth_mb
    ) as pool:
        pool.check_many(items[: workers * 4], 5)  # fork and warm every worker
        t0 = time.perf_counter()
        pool.check_many(items, 5)
        pooled = n / (time.perf_counter() - t0)
    return single, pooled


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


def overhead(
    workers: int, sizes: list[int], reps: int, broker: str | None
) -> list[tuple[int, float, float, float | None]]:
    import httpx

    spec = RewardSpec()
    data = {s: batches(s, reps) for s in sizes}
    rows: dict[int, list[float | None]] = {s: [] for s in sizes}
    s = get_reward_settings()  # the pool the service builds: same recycling, same limits
    with VerifierPool(
        workers,
        max_items=s.max_items_per_worker,
        max_rss_growth_mb=s.max_rss_growth_mb,
        mem_limit_mb=s.mem_limit_mb,
    ) as pool:
        score_group(data[sizes[0]][0], spec, pool.check_many)
        for s in sizes:
            t0 = time.perf_counter()
            for g in data[s]:
                score_group(g, spec, pool.check_many)
            rows[s].append((time.perf_counter() - t0) / reps)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(
        LOOM_REWARD_WORKERS=str(workers),
        LOOM_TORCH_THREADS="1",
        LOOM_DATA_DIR=f"/tmp/loom-bench-{os.getpid()}",
    )
    port = free_port()
    proc = subprocess.Popen(
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
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url)
        with httpx.Client(base_url=url, timeout=300) as c:
            body = lambda g: {"groups": [g.model_dump(mode="json")], "spec": spec.model_dump(mode="json")}  # noqa: E731
            c.post("/v1/rewards", json=body(data[sizes[0]][0]))
            for s in sizes:
                t0 = time.perf_counter()
                for g in data[s]:
                    c.post("/v1/rewards", json=body(g)).raise_for_status()
                rows[s].append((time.perf_counter() - t0) / reps)
    finally:
        stop(proc)
    if broker:
        ns = f"loombench-{uuid.uuid4().hex[:6]}-"
        qenv = dict(
            env,
            LOOM_BROKER_URL=broker,
            LOOM_RESULT_BACKEND="redis://127.0.0.1:6379/3",
            LOOM_QUEUE_NAMESPACE=ns,
        )
        worker = subprocess.Popen(
            [sys.executable, "-m", "loom.cli", "worker", "reward", "-c", "1"],
            cwd=REPO,
            env=qenv,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            os.environ.update({k: v for k, v in qenv.items() if k.startswith("LOOM_")})
            from loom.queue import make_celery
            from loom.settings import get_settings
            from reward_svc.tasks import submit_group

            get_settings.cache_clear()
            app = make_celery("reward", get_settings())
            submit_group(data[sizes[0]][0], spec, app=app).get(timeout=120)
            for s in sizes:
                t0 = time.perf_counter()
                for g in data[s]:
                    g2 = g.model_copy(update={"id": g.id + "-q"})
                    g2 = Group.model_validate(
                        {
                            **g2.model_dump(),
                            "trajectories": [{**t.model_dump(), "group_id": g2.id} for t in g.trajectories],
                        }
                    )
                    submit_group(g2, spec, app=app).get(timeout=300)
                rows[s].append((time.perf_counter() - t0) / reps)
        finally:
            stop(worker)
    else:
        for s in sizes:
            rows[s].append(None)
    return [(s, *rows[s]) for s in sizes]  # type: ignore[misc]


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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--deadline", type=int, default=3)
    p.add_argument(
        "--broker", default="amqp://guest:guest@127.0.0.1:5672//", help="'' to skip the queue path"
    )
    a = p.parse_args()

    single, pooled = throughput(a.workers, a.items)
    print(f"\n1. throughput on {a.items} realistic items (fresh gold parse per item)")
    print(f"{'in-process, 1 core':<32}{single:>10.1f} items/s")
    print(f"{f'pool, {a.workers} workers':<32}{pooled:>10.1f} items/s")
    print(f"{'ratio pool / (W x single)':<32}{pooled / (a.workers * single):>10.2f}   (target >= 0.8)")

    print(f"\n2. overhead vs in-process, same pool size ({a.workers}), mean of {a.reps} batches")
    print(f"{'batch':>6}{'in-proc s':>11}{'HTTP s':>10}{'HTTP +%':>9}{'queue s':>10}{'queue +%':>10}")
    for s, tin, thttp, tq in overhead(a.workers, [1, 16, 256], a.reps, a.broker or None):
        q = f"{tq:>10.3f}{100 * (tq - tin) / tin:>9.1f}%" if tq is not None else f"{'-':>10}{'-':>10}"
        print(f"{s:>6}{tin:>11.3f}{thttp:>10.3f}{100 * (thttp - tin) / tin:>8.1f}%{q}")

    print(f"\n3. hostile corpus, deadline {a.deadline} s, {a.workers} workers, 16 normal items in the batch")
    print(f"{'item':<44}{'status':<13}{'seconds':>8}")
    for name, status, sec in hostile_run(a.workers, a.deadline):
        flag = "" if sec <= a.deadline + 1 else "  OVER"
        print(f"{name:<44}{status:<13}{sec:>8.2f}{flag}")


if __name__ == "__main__":
    main()
