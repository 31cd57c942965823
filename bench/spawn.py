"""Spawn-mode benchmark (issue 6): do spawned children really run in parallel?

Target: wall time of a spawn rollout <= 1.5x the time of its longest dependent chain of calls, shown
side by side with the same rollouts with their children serialized.

Workload: Countdown prompts in the tiny model's spawn format (``zoo.tiny.spawn_prompt``), spawn mode
(``rollout_svc.modes.spawn``, default limits) on the in-process torch engine, one rollout at a time,
greedy (temperature 0). Greedy because the tiny model spawns reliably there and because the chain
replay below must reproduce the rollout token for token. Measured format validity before choosing:
12 of 12 Countdown prompts spawned one well-formed block with 2-3 children at temperature 0, 10 of
12 at temperature 1.0 (2 format errors); the bench counts and prints the rollouts that spawned.

Settings, run interleaved per prompt (same prompts, same params, prefix cache reset before each run):
  batched     ``TorchEngine(batching=True)``: the children of a block are decoded in one batch.
  serialized  ``TorchEngine(batching=False)``: one call at a time, children one after the other.
  chain       only the calls on the critical path, replayed alone and sequentially on the
              serialized engine with the recorded prompts and params: the parent's calls plus, for
              each spawn block, its longest child (most tokens). The replay must give the recorded
              tokens (checked). Its time is the longest dependent chain the target is measured against.
Reported per setting: rollouts, children, total tokens (all calls), sequential tokens (longest chain),
wall time (sum over rollouts of ``Group.meta["wall_s"]``; for the chain the replay time), and
wall/chain, and mismatches (serialized: rollouts whose tokens differ from the batched run; chain:
replayed calls whose tokens differ from the recording; both 0 expected). Both engines share one
model; torch runs on one thread (``LOOM_TORCH_THREADS``).

Usage: ``python bench/spawn.py [--prompts 16] [--repeats 2]`` (or ``loom bench spawn``); about a
minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.wire import Group, PolicyVersion, RolloutRequest, SamplingParams, Trajectory  # noqa: E402
from loom.runtime import configure_process  # noqa: E402
from rollout_svc.engines.base import Completion, Engine, Layout  # noqa: E402


@dataclass
class Call:
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int]


class Recorder(Engine):
    """Passes every call to ``inner`` and records its prompt, params and tokens."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.logprobs_kind = inner.logprobs_kind
        self.policy_version = inner.policy_version
        self.calls: list[Call] = []

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, layout: Layout | None = None
    ) -> list[Completion]:
        out: list[Completion] = await self.inner.generate(prompt_ids, params, layout)
        self.calls.append(Call(list(prompt_ids), params, list(out[0].token_ids)))
        return out

    async def load_policy(self, policy: PolicyVersion) -> None:
        await self.inner.load_policy(policy)

    async def reset_cache(self) -> None:
        await self.inner.reset_cache()


def critical_path(group: Group, calls: list[Call]) -> list[tuple[Call, int]]:
    """The calls (with their depth) of the longest dependent chain, in order: every call of the root
    and, before each join, the chain of the block's longest child (``meta["sequential_tokens"]``)."""
    by_id = {t.id: t for t in group.trajectories}
    unused = list(calls)

    def own_call(t: Trajectory, start: int) -> Call:
        prompt = t.prompt_ids + t.completion_ids[:start]
        for i, c in enumerate(unused):
            if c.prompt_ids == prompt:
                return unused.pop(i)
        raise LookupError(f"no recorded call of {t.id} at {start}")

    def chain(t: Trajectory) -> list[tuple[Call, int]]:
        out: list[tuple[Call, int]] = []
        for seg in t.segments:
            if seg.kind == "thread":
                out.append((own_call(t, seg.start), t.meta["depth"]))
            elif seg.meta.get("join"):
                kids = [by_id[k] for k in seg.meta["join"]]
                out += chain(max(kids, key=lambda k: k.meta["sequential_tokens"]))
        return out

    (root,) = [t for t in group.trajectories if t.parent_id is None]
    return chain(root)


@dataclass
class Totals:
    rollouts: int = 0
    spawned: int = 0
    children: int = 0
    total_tokens: int = 0
    sequential_tokens: int = 0
    wall_s: float = 0.0
    mismatches: int = 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of every prompt in every setting")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=11, help="seed of the Countdown problems")
    p.add_argument("--model", choices=("tiny", "search"), default="tiny", help="search: issue 29's model")
    a = p.parse_args()
    configure_process()
    import torch

    from loom.contracts.modes import parse_mode_params
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.modes.spawn import spawn
    from zoo.registry import resolve_model_path
    from zoo.search import search_problems
    from zoo.tiny import make_problems, spawn_prompt

    path = resolve_model_path(a.model)
    batched = TorchEngine(path, cache_entries=64, batching=True)
    serial = TorchEngine(
        path, cache_entries=64, batching=False, model=batched.model, tokenizer=batched.tokenizer
    )
    tok = batched.tokenizer
    requests = [
        RolloutRequest(
            mode="spawn",
            prompt=spawn_prompt(prob),
            sampling=SamplingParams(max_tokens=a.max_tokens, temperature=0.0, n=1),
        )
        for prob in (
            make_problems("countdown", a.prompts, seed=a.seed)
            if a.model == "tiny"
            else search_problems("countdown", a.prompts, seed=a.seed)
        )
    ]

    def run_spawn(engine: Any, req: RolloutRequest) -> tuple[Group, list[Call]]:
        rec = Recorder(engine)
        ids = tok.encode(req.prompt, add_special_tokens=False)

        async def go() -> Group:
            await engine.reset_cache()
            return await spawn(req, ids, "bench", rec, tok, parse_mode_params(req))

        return asyncio.run(go()), rec.calls

    def replay(path: list[Call]) -> tuple[float, int]:
        """Seconds to run ``path`` alone, one call after the other; calls whose tokens differ."""

        async def go() -> tuple[float, int]:
            await serial.reset_cache()
            t0 = time.perf_counter()
            outs = [await serial.generate(c.prompt_ids, c.params) for c in path]
            elapsed = time.perf_counter() - t0
            return elapsed, sum(o[0].token_ids != c.token_ids for o, c in zip(outs, path, strict=True))

        return asyncio.run(go())

    for engine in (batched, serial):  # warm-up
        run_spawn(engine, requests[0])
    settings = {"batched": Totals(), "serialized": Totals(), "chain": Totals()}
    for _ in range(a.repeats):
        for req in requests:
            ref: Group | None = None
            ref_calls: list[Call] = []
            for name, engine in (("batched", batched), ("serialized", serial)):
                group, calls = run_spawn(engine, req)
                s = settings[name]
                s.rollouts += 1
                s.spawned += group.meta["children"] > 0
                s.children += group.meta["children"]
                s.total_tokens += group.meta["total_tokens"]
                s.sequential_tokens += group.meta["sequential_tokens"]
                s.wall_s += group.meta["wall_s"]
                if ref is None:
                    ref, ref_calls = group, calls
                elif [t.completion_ids for t in group.trajectories] != [
                    t.completion_ids for t in ref.trajectories
                ]:
                    s.mismatches += 1  # batching changed a token (float rounding near a tie)
            assert ref is not None
            path = critical_path(ref, ref_calls)
            elapsed, bad = replay([call for call, _ in path])
            c = settings["chain"]
            c.rollouts += 1
            c.spawned += ref.meta["children"] > 0
            c.children += sum(depth > 0 for _, depth in path)
            c.total_tokens += sum(len(call.token_ids) for call, _ in path)
            c.sequential_tokens += sum(len(call.token_ids) for call, _ in path)
            c.wall_s += elapsed
            c.mismatches += bad

    chain_s = settings["chain"].wall_s
    print(
        f"{a.model} model, spawn mode, {a.prompts} Countdown prompts x {a.repeats}, greedy, "
        f"max_tokens={a.max_tokens}, device={batched.device}, torch threads={torch.get_num_threads()}"
    )
    head = (
        "setting",
        "rollouts",
        "spawned",
        "children",
        "total tok",
        "seq tok",
        "wall s",
        "wall/chain",
        "mismatch",
    )
    print("{:11s} {:>8s} {:>7s} {:>8s} {:>9s} {:>8s} {:>8s} {:>10s} {:>8s}".format(*head))
    for name, s in settings.items():
        cols = (s.rollouts, s.spawned, s.children, s.total_tokens, s.sequential_tokens)
        print(
            f"{name:11s} " + "{:8d} {:7d} {:8d} {:9d} {:8d}".format(*cols),
            f"{s.wall_s:8.2f} {s.wall_s / chain_s:10.3f} {s.mismatches:8d}",
        )
    b, sr = settings["batched"], settings["serialized"]
    print(
        f"wall(batched)/chain = {b.wall_s / chain_s:.3f} (target <= 1.5); "
        f"wall(serialized)/chain = {sr.wall_s / chain_s:.3f}; "
        f"serialized/batched = {sr.wall_s / b.wall_s:.3f}; "
        f"total/sequential tokens = {b.total_tokens / b.sequential_tokens:.3f}"
    )
    x = {k: int(v) for k, v in batched.stats.extra.items()}
    print(
        f"batched engine: {x['decode_steps']} decode forwards, {x['batched_steps']} with > 1 row, "
        f"max {x['peak_batch_rows']} rows / {x['peak_batch_requests']} requests in one forward"
    )


if __name__ == "__main__":
    main()
