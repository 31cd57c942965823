"""Agent mode's overhead: episodes through Loom's rollout service vs a plain loop over ``loom engine``.

The same episodes two ways, on the same machine, each server one process with its own torch engine
on the search model (one torch thread), the search model's plain Countdown prompts with the inline
calculator (a turn ends at ``=``, the calculator's exact result is appended: several turns an
episode), greedy so both sides decode the same ids:

- **loom**: ``POST /v1/rollouts`` of the rollout service (``loom api rollout``), mode ``agent``,
  ``parser: inline``: the episode loop of rollout_svc/modes/agent.py (token-in/token-out, segments,
  masks, log-probs), one request per prompt, the prompts at once;
- **plain**: a Python loop per prompt over ``loom engine``'s OpenAI-compatible ``/v1/completions``
  (token ids in, ``return_token_ids`` out, ``stop_token_ids`` the ``=``): turn, parse the arithmetic
  before the ``=``, run the calculator, append its encoded result, until a turn ends without one; the
  prompts at once.

The repetitions alternate (loom, plain, plain, loom, ...) after one warm-up of each; printed: the
median wall time of each side, overhead = median(loom) / median(plain) - 1 (target <= 10 %), the
episodes whose ids agree on both sides, turns and tokens per side.

    python bench/agent_overhead.py [--prompts 8] [--reps 4] [--max-tokens 64] [--max-turns 48]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

INLINE = re.compile(r"[0-9.+\-*/()]+\Z")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s")


def _observation(turn_text: str) -> str:
    """The plain loop's tool step: the arithmetic before the ``=``, the calculator's answer."""
    from rollout_svc.modes.agent import MALFORMED, ToolError, calculate

    m = INLINE.search(turn_text[:-1])
    if m is None:
        return MALFORMED
    try:
        return calculate(m.group(0))
    except ToolError as exc:
        return f"error: {exc}"


async def plain_episode(client: Any, tok: Any, ids: list[int], eq: int, a: argparse.Namespace) -> list[int]:
    out: list[int] = []
    for _ in range(a.max_turns):
        body = {
            "model": "search",
            "prompt": ids + out,
            "max_tokens": a.max_tokens,
            "temperature": 0.0,
            "stop_token_ids": [eq],
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        toks = list(choice["token_ids"])
        out += toks
        if choice["finish_reason"] != "stop" or not toks or toks[-1] != eq:
            break
        out += tok.encode(_observation(tok.decode(toks)), add_special_tokens=False)
    return out


async def loom_episode(client: Any, prompt: str, a: argparse.Namespace) -> list[int]:
    body = {
        "mode": "agent",
        "prompt": prompt,
        "sampling": {"n": 1, "max_tokens": a.max_tokens, "temperature": 0.0},
        "mode_params": {"parser": "inline", "max_turns": a.max_turns},
    }
    r = await client.post("/v1/rollouts", json=body)
    r.raise_for_status()
    return list(r.json()["trajectories"][0]["completion_ids"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-turns", type=int, default=48)
    a = p.parse_args()
    from transformers import AutoTokenizer

    from zoo.registry import resolve_model_path
    from zoo.search import search_problems
    from zoo.tiny import plain_prompt

    tok = AutoTokenizer.from_pretrained(str(resolve_model_path("search")))
    (eq,) = tok.encode("=", add_special_tokens=False)
    prompts = [plain_prompt(pr) for pr in search_problems("countdown", a.prompts, seed=7)]
    ids = [tok.encode(t, add_special_tokens=False) for t in prompts]
    tmp = Path(tempfile.mkdtemp(prefix="loom-agent-overhead-"))
    env = {**os.environ, "LOOM_TORCH_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env |= {"LOOM_MODEL": "search", "LOOM_DATA_DIR": str(tmp), "LOOM_BROKER_URL": "embedded"}
    env |= {"LOOM_RESULT_BACKEND": "embedded"}
    ports = {"engine": _free_port(), "rollout": _free_port()}
    cmds = {
        "engine": ["engine", "--model", "search", "--port", str(ports["engine"])],
        "rollout": ["api", "rollout", "--port", str(ports["rollout"])],
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "launch", *cmd],
            env=env,
            cwd=REPO,
            stdout=open(tmp / f"{name}.log", "w"),  # noqa: SIM115 - the process's log
            stderr=subprocess.STDOUT,
        )
        for name, cmd in cmds.items()
    ]
    load = os.getloadavg()
    try:
        urls = {k: f"http://127.0.0.1:{v}" for k, v in ports.items()}
        _wait(urls["engine"] + "/health")
        _wait(urls["rollout"] + "/healthz")
        result = asyncio.run(measure(urls, tok, ids, prompts, eq, a))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    loom_t, plain_t, loom_ids, plain_ids = result
    same = sum(x == y for x, y in zip(loom_ids, plain_ids, strict=True))
    turns = sum(tok.decode(x).count("=") for x in loom_ids)
    print(
        f"search model, {a.prompts} Countdown prompts at once, inline calculator, greedy, "
        f"max_tokens={a.max_tokens} per turn; load average at start {load[0]:.1f}, "
        f"end {os.getloadavg()[0]:.1f}"
    )
    print(f"episodes with the same ids on both sides: {same}/{len(loom_ids)}; tool calls (loom side) {turns}")
    print(f"tokens per rep: loom {sum(map(len, loom_ids))}, plain {sum(map(len, plain_ids))}")
    print("loom  s per rep:", " ".join(f"{x:.2f}" for x in loom_t))
    print("plain s per rep:", " ".join(f"{x:.2f}" for x in plain_t))
    over = statistics.median(loom_t) / statistics.median(plain_t) - 1
    print(f"median loom {statistics.median(loom_t):.2f} s, plain {statistics.median(plain_t):.2f} s")
    print(f"overhead {100 * over:+.1f} % (target <= 10 %)")


async def measure(
    urls: dict[str, str], tok: Any, ids: list[list[int]], prompts: list[str], eq: int, a: argparse.Namespace
) -> tuple[list[float], list[float], list[list[int]], list[list[int]]]:
    import httpx

    limits = httpx.Limits(max_connections=64)
    async with (
        httpx.AsyncClient(base_url=urls["rollout"], timeout=600, limits=limits) as loom,
        httpx.AsyncClient(base_url=urls["engine"], timeout=600, limits=limits) as plain,
    ):

        async def loom_rep() -> list[list[int]]:
            return list(await asyncio.gather(*(loom_episode(loom, t, a) for t in prompts)))

        async def plain_rep() -> list[list[int]]:
            return list(await asyncio.gather(*(plain_episode(plain, tok, x, eq, a) for x in ids)))

        loom_ids, plain_ids = await loom_rep(), await plain_rep()  # warm-up
        times: dict[str, list[float]] = {"loom": [], "plain": []}
        order = ["loom", "plain", "plain", "loom"]
        for r in range(a.reps):
            for side in order[r % 2 * 2 : r % 2 * 2 + 2]:
                t0 = time.perf_counter()
                await (loom_rep() if side == "loom" else plain_rep())
                times[side].append(time.perf_counter() - t0)
    return times["loom"], times["plain"], loom_ids, plain_ids


if __name__ == "__main__":
    main()
