"""Fair share of the rollout tier: one key's small job under another key's flood, against its solo
latency (docs/benchmarks/fairness.md, docs/operations.md "Fair share").

Real processes on a real broker: ``loom api gateway``, ``loom worker rollout`` (the torch engine with
the built-in tiny model) and ``loom worker reward``, on RabbitMQ at 127.0.0.1:5672 (guest/guest;
queues under a namespace of this run's own, deleted at the end), results in the data dir's SQLite
store. Key ``flood`` submits ``--flood`` jobs of ``--prompts`` prompts; once the rollout tier is busy,
key ``small`` submits one job of one prompt. Its latency (submit to ``succeeded``) is compared with
its solo latency (the same job alone, median of ``--solo`` runs) and with the target "within 2x its
solo latency plus one group's time" (one group's time under the flood: the flood's wall time x the
gateway's window / its groups, the time a group holds a slot of the broker's window). The same
flood is run with the gateway's fair scheduler (deficit round robin across keys) and without it
(``LOOM_GATEWAY_FAIR_SHARE=false``: first come first served in the broker), side by side.

    python bench/fairness.py [--flood 16] [--prompts 4] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
KEYS = {"flood": "loom_bench_flood_key", "small": "loom_bench_small_key"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(data_dir: str, namespace: str, window: int, fair: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    keys = ",".join(f"{name}:{hashlib.sha256(k.encode()).hexdigest()}" for name, k in KEYS.items())
    env.update(
        PYTHONPATH=str(REPO),
        LOOM_DATA_DIR=data_dir,
        LOOM_BROKER_URL=RABBITMQ,
        LOOM_RESULT_BACKEND="embedded",
        LOOM_QUEUE_NAMESPACE=namespace,
        LOOM_API_KEYS=keys,
        LOOM_GATEWAY_BURST="1000",
        LOOM_GATEWAY_ROLLOUT_WINDOW=str(window),
        LOOM_GATEWAY_FAIR_SHARE="true" if fair else "false",
    )
    return env


def spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "launch.cli", *argv],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{log.name} did not get ready:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@contextmanager
def gateway(env: dict[str, str], log: Path) -> Iterator[str]:
    port = free_port()
    proc = spawn(["api", "gateway", "--host", "127.0.0.1", "--port", str(port)], env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def job(key: str, prompts: int, max_tokens: int) -> dict[str, Any]:
    return {
        "job_key": key,
        "prompts": [f"Compute {i % 90 + 10}+{i % 7 + 2}." for i in range(prompts)],
        "sampling": {"n": 4, "max_tokens": max_tokens, "temperature": 1.0},
    }


def submit(c: httpx.Client, key: str, body: dict[str, Any]) -> str:
    r = c.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {KEYS[key]}"})
    if r.status_code != 201:
        raise RuntimeError(f"submission refused: {r.status_code} {r.text}")
    return str(r.json()["id"])


def wait_done(c: httpx.Client, key: str, job_id: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    auth = {"Authorization": f"Bearer {KEYS[key]}"}
    while True:
        status = c.get(f"/v1/jobs/{job_id}", params={"limit": 1}, headers=auth).json()["status"]
        if status == "succeeded":
            return
        if status in ("failed", "cancelled") or time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id}: {status}")
        time.sleep(0.02)


def small_latency(c: httpx.Client, tag: str, max_tokens: int) -> float:
    t0 = time.perf_counter()
    wait_done(c, "small", submit(c, "small", job(f"small-{tag}", 1, max_tokens)), 900)
    return time.perf_counter() - t0


def flood_round(c: httpx.Client, args: argparse.Namespace, tag: str) -> tuple[float, float]:
    """(the small job's latency under the flood, the flood's wall time)."""
    t0 = time.perf_counter()
    ids = [
        submit(c, "flood", job(f"flood-{tag}-{j}", args.prompts, args.max_tokens)) for j in range(args.flood)
    ]
    time.sleep(args.lead)  # the rollout tier is busy with the flood
    latency = small_latency(c, f"under-{tag}", args.max_tokens)
    for job_id in ids:
        wait_done(c, "flood", job_id)
    return latency, time.perf_counter() - t0


def measure(args: argparse.Namespace, env: dict[str, str], root: Path, tag: str) -> dict[str, float]:
    with gateway(env, root / f"gateway-{tag}.log") as url, httpx.Client(base_url=url, timeout=60) as c:
        small_latency(c, f"warm-{tag}", args.max_tokens)  # the engine's first batch
        solo = statistics.median(
            small_latency(c, f"solo-{tag}-{i}", args.max_tokens) for i in range(args.solo)
        )
        under, wall = flood_round(c, args, tag)
    groups = args.flood * args.prompts
    group_s = wall * args.window / groups  # a group's hold of one slot of the window
    return {"solo": solo, "under": under, "wall": wall, "group": group_s}


def delete_namespace(namespace: str) -> None:
    from kombu import Connection

    from loom.contracts.settings import SERVICES

    with Connection(RABBITMQ, connect_timeout=5) as conn:
        for service in SERVICES:
            for delete in ("queue_delete", "exchange_delete"):
                channel = conn.channel()
                try:
                    getattr(channel, delete)(f"{namespace}{service}")
                except Exception:  # already gone: that closes the channel
                    pass
                finally:
                    try:
                        channel.close()
                    except Exception:
                        pass


def report(name: str, m: dict[str, float]) -> None:
    target = 2 * m["solo"] + m["group"]
    print(
        f"{name:>24}: small job solo {m['solo']:6.2f} s, under the flood {m['under']:6.2f} s "
        f"(x{m['under'] / m['solo']:.1f} solo); target 2 x solo + one group ({m['group']:.2f} s) = "
        f"{target:.2f} s: under/target {m['under'] / target:.2f} "
        f"({'met' if m['under'] <= target else 'MISSED'}); flood wall {m['wall']:.1f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--flood", type=int, default=16, help="jobs of key 'flood'")
    p.add_argument("--prompts", type=int, default=4, help="prompts per flood job (one group each)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="groups the rollout worker runs at once")
    p.add_argument("--solo", type=int, default=3, help="solo runs of the small job (median)")
    p.add_argument("--lead", type=float, default=2.0, help="s between the flood and the small job")
    args = p.parse_args()
    # the window: what the replica takes at once (its pool: running + as many ready, engine process)
    args.window = 2 * args.concurrency
    namespace = f"bench-fair-{uuid.uuid4().hex[:8]}-"
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        fair_env = base_env(d, namespace, args.window, fair=True)
        workers = []
        try:
            for service, conc in (("rollout", args.concurrency), ("reward", 1)):
                log = root / f"worker-{service}.log"
                workers.append((spawn(["worker", service, "-c", str(conc)], fair_env, log), log))
            for proc, log in workers:
                wait_for(log, " ready.", proc)
            results = {
                "fair (DRR across keys)": measure(args, fair_env, root, "fair"),
                "first come first served": measure(
                    args, base_env(d, namespace, args.window, False), root, "fifo"
                ),
            }
        finally:
            for proc, _ in workers:
                proc.terminate()
            for proc, _ in workers:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            delete_namespace(namespace)
    groups = args.flood * args.prompts
    print(
        f"flood: {args.flood} jobs x {args.prompts} prompts = {groups} groups (n=4, max_tokens "
        f"{args.max_tokens}); small: 1 job of 1 group; rollout worker -c {args.concurrency} (torch, tiny "
        f"model), gateway window {args.window}; RabbitMQ"
    )
    for name, m in results.items():
        report(name, m)


if __name__ == "__main__":
    main()
