"""The policy store over HTTP vs a local copy, side by side in one run.

A version of ``--mb`` MB (two files of random bytes) is published to a store; the learner API serves
it (``loom api learner`` on 127.0.0.1, its own process); then, ``--repeats`` times each, alternating:

- pull: ``RemotePolicyStore.get`` into an empty cache (HTTP stream, sha256 of every byte, rename;
  the first pull also pays the server's hashing, which makes the version's manifest);
- copy: ``shutil.copytree`` of the version folder (what a shared volume costs at best: no network);
- cached: ``get`` again on a cache that holds it (a manifest-free local read).

Prints the medians and pull/copy. Run: ``loom bench policy_store`` (or ``python bench/policy_store.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from loom.store import PolicyStore, RemotePolicyStore  # noqa: E402


def serve(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``loom api learner`` on ``data_dir`` in its own process (server and client share no GIL)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LOOM_DATA_DIR": str(data_dir), "LOOM_LEARNER_PORT": str(port)}
    env["LOOM_SERVICE_TOKEN"] = "bench"
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "api", "learner"], cwd=repo, env=env, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("loom api learner did not start")


def main(argv: Sequence[str] = ()) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(list(argv) or None)
    root = Path(tempfile.mkdtemp(prefix="loom-bench-store-"))
    try:
        store = PolicyStore(root / "learner" / "policy")
        half = args.mb << 19

        def write(d: Path) -> None:
            for i in range(2):
                (d / f"model-{i}.safetensors").write_bytes(os.urandom(half))

        store.publish(1, write)
        server, url = serve(root / "learner")
        pulls, copies, cached = [], [], []
        for i in range(args.repeats):
            cache = root / f"cache{i}"
            remote = RemotePolicyStore(url, cache, token="bench")
            t = time.perf_counter()
            remote.get(1)
            pulls.append(time.perf_counter() - t)
            t = time.perf_counter()
            remote.get(1)
            cached.append(time.perf_counter() - t)
            t = time.perf_counter()
            shutil.copytree(store.path_of(1), root / f"copy{i}")
            copies.append(time.perf_counter() - t)
            shutil.rmtree(cache)
            shutil.rmtree(root / f"copy{i}")
        server.terminate()
        server.wait(30)
        pull, copy, hit = (statistics.median(x) for x in (pulls, copies, cached))
        print(f"version of {args.mb} MB, median of {args.repeats}:")
        print(f"  pull over HTTP (stream + sha256 + rename): {pull:.2f} s  ({args.mb / pull:.0f} MB/s)")
        print(f"  local copytree:                            {copy:.2f} s  ({args.mb / copy:.0f} MB/s)")
        print(f"  cached get:                                {hit * 1000:.1f} ms")
        print(f"  pull / copy = {pull / copy:.1f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
