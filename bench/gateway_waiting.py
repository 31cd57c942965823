"""What waiting jobs cost the gateway: threads and memory of a gateway process holding N queued jobs.

A real gateway process (``loom api gateway``) on the embedded broker with no worker: N jobs of P
prompts each are submitted and wait on their queued rollout tasks; the gateway's thread count and RSS
are read once every task is queued (docs/security.md, "A job costs no thread while it waits").

    python bench/gateway_waiting.py [--jobs 99] [--prompts 8]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

KEY = "loom_bench_waiting"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=99)
    p.add_argument("--prompts", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
        env.update(
            LOOM_DATA_DIR=d,
            LOOM_API_KEYS=f"bench:{hashlib.sha256(KEY.encode()).hexdigest()}",
            LOOM_GATEWAY_BURST="100000",
            LOOM_GATEWAY_QUOTA_JOBS=str(args.jobs),
            # every waiting task in the broker, where this bench counts them (the fair scheduler's
            # window would keep the rest in the gateway, as futures too)
            LOOM_GATEWAY_ROLLOUT_WINDOW=str(args.jobs * min(args.prompts, 8)),
        )
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "launch.cli",
            "api",
            "gateway",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        log = open(Path(d) / "gateway.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as c:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if c.get("/healthz").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the gateway did not start")
                    time.sleep(0.2)
                gw = psutil.Process(proc.pid)
                threads0, rss0 = gw.num_threads(), gw.memory_info().rss
                for j in range(args.jobs):
                    body = {"job_key": f"w{j}", "prompts": [f"q{j}.{i}" for i in range(args.prompts)]}
                    r = c.post("/v1/jobs", json=body)
                    assert r.status_code == 201, r.text
                want = args.jobs * min(args.prompts, 8)  # a job has at most 8 prompts in flight
                deadline = time.monotonic() + 120
                while True:
                    n = _rollout_depth(d)
                    if n >= want or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                threads, rss = gw.num_threads(), gw.memory_info().rss
        finally:
            proc.terminate()
            proc.wait(30)
            log.close()
    print(f"{args.jobs} waiting jobs x {args.prompts} prompts ({n} rollout tasks queued):")
    print(f"  gateway threads {threads0} idle -> {threads} waiting ({threads - threads0:+d})")
    print(f"  gateway RSS {rss0 / 2**20:.0f} MB idle -> {rss / 2**20:.0f} MB waiting")


def _rollout_depth(data_dir: str) -> int:
    from loom.contracts.settings import Settings
    from loom.queue import make_celery, queue_depths

    app = make_celery("gateway", Settings(data_dir=Path(data_dir)))
    try:
        return int(queue_depths(app).get("rollout") or 0)
    finally:
        app.close()


if __name__ == "__main__":
    main()
