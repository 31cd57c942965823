"""Judge-reward benchmark (docs/interop-reward.md "Judge rewards"): the ``judge`` component through
the reward core and ``loom.clients.judge``, against the judge server's own throughput.

One ``loom engine --model tiny`` is the judge. For 1, 8 and 64 groups in flight (8 trajectories a
group), the same prompts are judged (a) straight: one ``/v1/completions`` POST per prompt, as many in
flight as the groups' trajectories, on the client's connection lanes (``loom.clients.judge.Lanes``:
one httpx pool of hundreds of connections costs more CPU than the requests), and (b) through
``reward_svc.core.ascore_group`` with a ``JudgeClient`` (its limits wide open, its cache off: every
prompt is new to it). Items/s of each and the ratio (b)/(a), A/B in alternating rounds so machine
noise hits both alike.

    .venv/bin/python bench/judge.py [--groups 64] [--rounds 2] [--in-flight 1,8,64]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.rollout import Procs, start_engine_server  # noqa: E402
from loom.clients.judge import JudgeClient, Lanes  # noqa: E402
from loom.contracts.reward_settings import JudgeServer  # noqa: E402
from loom.contracts.rewards import JudgeParams  # noqa: E402
from loom.contracts.wire import Group, RewardComponent, RewardSpec, Trajectory  # noqa: E402
from reward_svc.core import ascore_group  # noqa: E402
from reward_svc.judge import JudgeVerdict, plan_asks  # noqa: E402

PER_GROUP = 8
MAX_TOKENS = 4


def groups(n: int, tag: str) -> list[Group]:
    out = []
    for g in range(n):
        trajs = [
            Trajectory(id=f"{g}-{i}", group_id=f"{tag}{g}", text=f"{g + i} apples") for i in range(PER_GROUP)
        ]
        out.append(
            Group(id=f"{tag}{g}", prompt=f"[{tag}] What is {g} + 3?", label=f"{g + 3}", trajectories=trajs)
        )
    return out


async def _no_verify(items: Any, timeout: int) -> list[Any]:
    return []


async def through_core(url: str, model: str, gs: list[Group], in_flight: int) -> float:
    client = JudgeClient({"j": JudgeServer(url=url, model=model, max_concurrency=1024)}, cache_size=0)
    spec = RewardSpec(
        components=[RewardComponent(name="judge", params={"judge": "j", "max_tokens": MAX_TOKENS})]
    )
    sem = asyncio.Semaphore(in_flight)

    async def one(g: Group) -> None:
        async with sem:
            r = await ascore_group(g, spec, _no_verify, ask_judge=client.ask_batch)
            assert all(x.status in ("ok", "judge_unparsable") for x in r.rewards), r.rewards[0]

    t0 = time.perf_counter()
    await asyncio.gather(*(one(g) for g in gs))
    return len(gs) * PER_GROUP / (time.perf_counter() - t0)


async def straight(url: str, model: str, gs: list[Group], in_flight: int) -> float:
    params = JudgeParams(judge="j", max_tokens=MAX_TOKENS)
    prompts = [a.prompt for g in gs for a in plan_asks(g, params) if not isinstance(a, JudgeVerdict)]
    sem = asyncio.Semaphore(in_flight * PER_GROUP)
    http = Lanes()  # the client's own connection lanes: one pool of hundreds is slow (Lanes)

    async def one(p: str) -> None:
        async with sem:
            body = {"model": model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0}
            (await http.post(f"{url}/v1/completions", body, 120)).raise_for_status()

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return len(prompts) / (time.perf_counter() - t0)
    finally:
        await http.aclose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=64, help="groups per leg")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--in-flight", default="1,8,64")
    args = ap.parse_args()
    procs = Procs()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            url = start_engine_server(procs, Path(tmp), ["--model", "tiny"])
            while True:
                try:
                    model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
                    break
                except (httpx.HTTPError, KeyError, ValueError):
                    time.sleep(0.3)
            asyncio.run(straight(url, model, groups(2, "warm"), 1))  # the engine's first batch
            print(f"judge: loom engine --model tiny, {PER_GROUP} items a group, {args.groups} groups a leg")
            print(f"{'in flight':>9} {'straight items/s':>17} {'core items/s':>13} {'ratio':>6}")
            for k in (int(x) for x in args.in_flight.split(",")):
                a: list[float] = []
                b: list[float] = []
                for r in range(args.rounds):
                    legs = [("s", straight), ("c", through_core)]
                    for tag, leg in legs if r % 2 == 0 else legs[::-1]:
                        rate = asyncio.run(leg(url, model, groups(args.groups, f"{k}{tag}{r}-"), k))
                        (a if tag == "s" else b).append(rate)
                sa, sb = sum(a) / len(a), sum(b) / len(b)
                print(f"{k:>9} {sa:>17.1f} {sb:>13.1f} {sb / sa:>6.2f}", flush=True)
    finally:
        procs.close()


if __name__ == "__main__":
    main()
