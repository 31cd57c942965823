"""A 150k-line JSONL run dataset submitted to a real gateway process, two ways, side by side:

(a) inline (``dataset.jsonl`` in the run's JSON body), (b) streamed (``POST /v1/datasets`` in chunks,
then the run names its id). Prints each request's seconds and the gateway's RSS after it, and the
ratios. The gateway's run loop is off: what is measured is the submission, not the run.

    python bench/gateway_datasets.py [--lines 150000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import psutil

KEY = "loom_bench_datasets"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gateway(data_dir: str) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(
        LOOM_DATA_DIR=data_dir,
        LOOM_API_KEYS=f"bench:{hashlib.sha256(KEY.encode()).hexdigest()}",
        LOOM_GATEWAY_RUN_LOOP="false",
        LOOM_MAX_BODY_BYTES=str(64 * 2**20),
    )
    port = free_port()
    argv = [sys.executable, "-m", "launch.cli", "api", "gateway", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the gateway did not start")
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", type=int, default=150_000)
    args = p.parse_args()
    text = "".join(
        json.dumps({"prompt": f"What is {i} + 1?", "answer": i + 1}) + "\n" for i in range(args.lines)
    )
    data = text.encode()

    def chunks() -> Iterator[bytes]:
        for k in range(0, len(data), 65536):
            yield data[k : k + 65536]

    results = {}
    for way in ("inline", "streamed"):
        with tempfile.TemporaryDirectory() as d:
            proc, url = gateway(d)
            try:
                rss0 = psutil.Process(proc.pid).memory_info().rss
                with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
                    t0 = time.perf_counter()
                    if way == "inline":
                        r = c.post("/v1/runs", json={"dataset": {"jsonl": text}})
                    else:
                        up = c.post(
                            "/v1/datasets", content=chunks(), headers={"content-type": "application/x-ndjson"}
                        )
                        assert up.status_code == 201, up.text
                        r = c.post("/v1/runs", json={"dataset": {"id": up.json()["id"]}})
                    seconds = time.perf_counter() - t0
                    assert r.status_code == 201, r.text[:500]
                rss = psutil.Process(proc.pid).memory_info().rss
            finally:
                proc.terminate()
                proc.wait(30)
        results[way] = (seconds, rss0, rss)
        print(f"{way:<9} {args.lines} lines ({len(data) / 2**20:.1f} MB): {seconds:.2f} s, gateway RSS "
              f"{rss0 / 2**20:.0f} -> {rss / 2**20:.0f} MB")  # fmt: skip
    (ti, _, ri), (ts, _, rs) = results["inline"], results["streamed"]
    print(f"streamed / inline: time {ts / ti:.2f}, RSS after {rs / ri:.2f}")


if __name__ == "__main__":
    main()
