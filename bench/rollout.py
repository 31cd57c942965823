"""Rollout benchmarks, measured side by side in one run (issue 5).

1. Orchestration overhead: the same plain groups (same prompts, same seeds, so the same tokens) run
   (a) by direct calls to the engine and (b) through the queue: published as ``rollout.generate_group``
   tasks to one rollout worker running the same engine. Target <= 5 %. Three engines (``--engines``):
   ``process`` (the default torch engine, ``ProcessEngine``: its model runs in a child process of
   the bench process / of the worker), ``in-process`` (``LOOM_ENGINE_PROCESS=false``: the torch
   engine inside the bench process / inside the worker, whose own Python then shares the engine's
   GIL) and ``server`` (one ``loom engine`` process, called by the vLLM client from the bench process /
   from the worker: the deployed shape, vLLM on a GPU host). 1 and 4 groups in flight
   (``--concurrency``); embedded broker and RabbitMQ + Redis (``--brokers``). Beside each overhead,
   its split: at 1 in flight, the time outside the engine per group; at 4, the mean number of groups
   in the engine in each leg (the groups' engine seconds over the wall time), whose shortfall in the
   queue leg is the orchestration's idle engine slots, and the engine's own time for the same tokens.
2. Streaming prefill: the same streaming rollouts (built-in tiny model, its stream format) on a
   torch engine with prefix-KV reuse and on one without (naive re-prefill every round); tokens the
   model computed / final sequence length. Target <= 1.15x with reuse.
3. Replica scaling: throughput of 1, 2, 4, 8 rollout workers, each with its own ``loom engine
   --simulate-ms-per-token`` server (SIMULATION: fixed per-token latency, random tokens), on
   RabbitMQ (+ Redis results) when reachable, else the embedded broker. Target >= 0.85x linear at 8.
4. The real vLLM (``--only vllm``; its environment from deploy/vllm-setup.sh, docs/vllm.md): the
   orchestration overhead of benchmark 1 with a vLLM 0.32 server as the engine (direct vLLM calls
   by the vllm client against the same calls through the queue and a rollout worker; target <= 5 %),
   then vLLM's decode tokens/s against the torch engine's (``loom engine``, as many torch threads as
   the machine has cores, as vLLM's CPU backend uses) at 4 and 16 requests in flight, the same
   client and requests against each server, back to back.

Usage: ``loom bench rollout [--quick] [--only overhead,prefill,scaling,vllm]
[--engines process,in-process,server] [--concurrency 1,4] [--brokers embedded,rabbitmq] [--ready N]
[--vllm-eager] [--timeline]``. Model: LOOM_MODEL (tiny). ``--timeline``: the workers run with
``LOOM_TIMELINE`` (loom/timeline.py) and each queue leg's groups are split into publish -> task start
(broker pickup), task start -> engine call, the engine call, engine done -> task end, task end ->
result read by the bench (median and max ms over the leg's groups), printed after the table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.settings import Settings, get_settings  # noqa: E402
from loom.contracts.wire import RolloutRequest, SamplingParams  # noqa: E402
from loom.runtime import configure_process  # noqa: E402

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
TIMELINE: Path | None = None  # --timeline: the marks file (loom/timeline.py) of the workers and this process
TIMELINES: list[dict[str, Any]] = []  # one per queue leg
REDIS = "redis://127.0.0.1:6379/4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class Procs:
    """Child processes of this benchmark, each in its own session; all killed on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            p = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def queue_env(data_dir: Path, rabbit: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(LOOM_DATA_DIR=str(data_dir), LOOM_TORCH_THREADS="1", PYTHONUNBUFFERED="1")
    if rabbit:
        env.update(
            LOOM_BROKER_URL=RABBITMQ,
            LOOM_RESULT_BACKEND=REDIS,
            LOOM_QUEUE_NAMESPACE=f"loombench-{uuid.uuid4().hex[:8]}-",
        )
    else:
        env.update(LOOM_BROKER_URL="embedded", LOOM_RESULT_BACKEND="embedded")
    if TIMELINE is not None:
        env["LOOM_TIMELINE"] = str(TIMELINE)
    env.update(extra)
    return env


def start_workers(procs: Procs, env: dict[str, str], n: int, tmp: Path, concurrency: int = 1) -> None:
    logs = []
    for i in range(n):
        log = tmp / f"worker-{uuid.uuid4().hex[:6]}.log"
        argv = [
            sys.executable,
            "-m",
            "launch.cli",
            "worker",
            "rollout",
            "-c",
            str(concurrency),
            "-n",
            f"bench{i}-{log.stem}@%h",
        ]
        procs.start(argv, env, log)
        logs.append(log)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if all(" ready." in log.read_text(errors="replace") for log in logs):
            return
        time.sleep(0.2)
    raise RuntimeError("rollout workers did not start")


def celery_for(env: dict[str, str]) -> Any:
    from loom.queue import make_celery

    values = {k[len("LOOM_") :].lower(): v for k, v in env.items() if k.startswith("LOOM_")}
    return make_celery("rollout", Settings(**values))


def run_through_queue(app: Any, requests: list[RolloutRequest]) -> tuple[float, int, float]:
    """Seconds to get every group back, the completion tokens they hold, and the engine's own seconds
    (the groups' ``generate_s``). Results are awaited the way the gateway awaits its stages
    (``gateway.pipeline.CeleryStages._result``), so the overhead measured is the one a run sees."""
    from gateway.pipeline import CeleryStages
    from loom.contracts.tasks import GENERATE_GROUP
    from loom.queue import send
    from loom.timeline import mark

    stages = CeleryStages(app)
    t0 = time.perf_counter()
    pending = []
    for r in requests:
        mark("publish", r.group_id or "")
        pending.append(send(app, GENERATE_GROUP, r, key=r.group_id))

    async def wait_all() -> list[Any]:
        return list(await asyncio.gather(*(stages._result(p.id) for p in pending)))

    groups = dict(enumerate(asyncio.run(wait_all())))
    stages.close()
    elapsed = time.perf_counter() - t0
    tokens = sum(len(t["completion_ids"]) for g in groups.values() for t in g["trajectories"])
    engine_s = sum(g["trajectories"][0]["timing"]["generate_s"] for g in groups.values())
    if TIMELINE is not None:
        TIMELINES.append(leg_timeline(TIMELINE, [r.group_id or "" for r in requests], elapsed))
    return elapsed, tokens, engine_s


_SPANS = (
    ("pickup", "publish", "task_start"),
    ("to engine", "task_start", "engine_call"),
    ("engine", "engine_call", "engine_done"),
    ("to end", "engine_done", "task_end"),
    ("result back", "task_end", "result"),
)


def leg_timeline(path: Path, keys: list[str], elapsed: float) -> dict[str, Any]:
    """One queue leg's groups split into spans (``_SPANS``): median and max ms over its groups."""
    from loom.timeline import read

    at: dict[str, dict[str, float]] = {k: {} for k in keys}
    for m in read(path):
        if m["key"] in at:
            at[m["key"]].setdefault(m["event"], m["t"])
    out: dict[str, Any] = {"groups": len(keys), "leg_s": round(elapsed, 3)}
    for name, a, b in _SPANS:
        ms = [1e3 * (e[b] - e[a]) for e in at.values() if a in e and b in e]
        if ms:
            out[name] = (round(statistics.median(ms), 1), round(max(ms), 1))
    return out


# ------------------------------------------------------------------------------------------------


def plain_requests(tokenizer: Any, n_groups: int, max_tokens: int) -> list[RolloutRequest]:
    from zoo.tiny import make_problems, plain_prompt

    problems = make_problems("arith", n_groups, seed=5)
    return [
        RolloutRequest(
            group_id=f"bench-{uuid.uuid4().hex[:8]}",
            prompt_ids=tokenizer.encode(plain_prompt(p), add_special_tokens=False),
            sampling=SamplingParams(n=4, max_tokens=max_tokens, seed=i, temperature=1.0),
        )
        for i, p in enumerate(problems)
    ]


def start_engine_server(procs: Procs, tmp: Path, args: list[str], wait: bool = True, **env: str) -> str:
    """``loom engine`` (the torch engine behind the vLLM-compatible protocol; ``args`` e.g. its
    simulation flag) on a free port; its URL, once it answers unless ``wait`` is False."""
    port = free_port()
    argv = [sys.executable, "-m", "launch.cli", "engine", "--port", str(port), *args]
    procs.start(argv, queue_env(tmp, False, **env), tmp / f"engine-{port}.log")
    deadline = time.monotonic() + 180
    while wait and not reachable(port):
        if time.monotonic() > deadline:
            raise RuntimeError("loom engine did not start")
        time.sleep(0.2)
    return f"http://127.0.0.1:{port}"


def bench_overhead(
    quick: bool,
    tmp: Path,
    rabbit: bool = False,
    pool: str = "threads",
    concurrency: int = 1,
    engine_kind: str = "process",
    ready: int = -1,
    vllm_eager: bool = False,
) -> dict[str, float]:
    """Direct and queued runs alternate (A/B per round) so machine noise hits both alike. ``rabbit``:
    RabbitMQ + Redis (the deployed broker), else the embedded SQLite broker. ``concurrency`` c: the
    direct leg keeps c groups in flight on the engine at once (its scheduler batches them) and the
    worker runs with ``-c c`` (c groups in flight, the same batching); a round holds 4 c groups and
    there are 24 / c rounds, so every c runs the same 96 groups. ``engine_kind``: ``server``, a
    ``loom engine`` process (the deployed shape: vLLM on a GPU host) that the direct leg calls with
    the vLLM client, and the worker (``LOOM_ENGINE_URL``) with the same client; ``process``, each leg
    has its own ``ProcessEngine`` (the model in a child process of the bench process / of the
    worker); ``in-process``, each leg runs the torch engine in its own process; ``vllm``, as
    ``server`` with a real vLLM server."""
    from rollout_svc.engines.process import ProcessEngine
    from rollout_svc.engines.torch import TorchEngine, load_tokenizer, resolve_model_path
    from rollout_svc.engines.vllm import VLLMEngine
    from rollout_svc.rollout import generate_group

    settings = get_settings()
    path = resolve_model_path(settings.model)
    procs = Procs()
    server = engine_kind in ("server", "vllm")
    vllm = start_vllm(tmp, path, eager=vllm_eager) if engine_kind == "vllm" else None
    url = vllm.url if vllm is not None else ""
    if engine_kind == "server":
        url = start_engine_server(procs, tmp, [], LOOM_MODEL=str(path))
    entries = settings.engine_prefix_cache_entries
    engine: Any
    if server:
        engine = VLLMEngine(url)
        engine.tokenizer = load_tokenizer(path)
    elif engine_kind == "process":
        engine = ProcessEngine(path, cache_entries=entries)
    elif engine_kind == "in-process":
        engine = TorchEngine(path, cache_entries=entries)
    else:
        raise ValueError(f"unknown engine {engine_kind!r}: process, in-process or server")
    rounds, per_round, max_tokens = (2, 3, 64) if quick else (max(1, 24 // concurrency), 4 * concurrency, 128)
    reqs = plain_requests(engine.tokenizer, per_round + 1, max_tokens)
    warm, reqs = reqs[0], reqs[1:]

    async def direct() -> tuple[float, int, float]:
        t0 = time.perf_counter()
        slots = asyncio.Semaphore(concurrency)

        async def one(r: RolloutRequest) -> Any:
            async with slots:
                return await generate_group(r, engine, lambda: engine.tokenizer, settings)

        groups = await asyncio.gather(*(one(r) for r in reqs))
        return (
            time.perf_counter() - t0,
            sum(len(t.completion_ids) for g in groups for t in g.trajectories),
            sum(g.trajectories[0].timing["generate_s"] for g in groups),
        )

    t_direct = t_queue = e_direct = e_queue = 0.0
    tok_direct = tok_queue = 0
    pairs: list[float] = []  # queue / direct - 1 of each A/B pair: the machine's drift cancels
    try:
        env = queue_env(
            tmp / ("q-rabbit" if rabbit else "q-embedded"),
            rabbit,
            LOOM_ENGINE="vllm" if server else "torch",
            LOOM_ENGINE_URL=url,
            LOOM_ENGINE_PROCESS=str(engine_kind == "process").lower(),
            LOOM_MODEL=str(path),
            LOOM_ROLLOUT_POOL=pool,
            LOOM_ROLLOUT_READY=str(ready),
        )
        start_workers(procs, env, 1, tmp, concurrency=concurrency)
        app = celery_for(env)
        loop = asyncio.new_event_loop()  # one loop for every direct leg: the HTTP client keeps it
        loop.run_until_complete(generate_group(warm, engine, lambda: engine.tokenizer, settings))
        run_through_queue(app, [warm.model_copy(update={"group_id": f"warm-{uuid.uuid4().hex[:6]}"})])
        for _ in range(rounds):
            dt_d, nt, eng = loop.run_until_complete(direct())
            t_direct, tok_direct, e_direct = t_direct + dt_d, tok_direct + nt, e_direct + eng
            queued = [r.model_copy(update={"group_id": f"q-{uuid.uuid4().hex[:8]}"}) for r in reqs]
            dt_q, nt, eng = run_through_queue(app, queued)
            t_queue, tok_queue, e_queue = t_queue + dt_q, tok_queue + nt, e_queue + eng
            pairs.append(dt_q / dt_d - 1)
        app.close()
        loop.run_until_complete(engine.close())
        loop.close()
    finally:
        procs.close()
        if vllm is not None:
            vllm.stop()
    groups = rounds * len(reqs)
    return {
        "groups": groups,
        "median_overhead": statistics.median(pairs),
        "direct_s": t_direct,
        "queue_s": t_queue,
        "overhead": t_queue / t_direct - 1,
        # the same tokens computed by the same engine code in two processes: what the engine took in
        # each is the machine's noise (+-20 % per round seen here); the rest is the orchestration
        "engine_ratio": e_queue / e_direct - 1,
        "orchestration_ms": 1e3 * ((t_queue - e_queue) - (t_direct - e_direct)) / groups,
        "orchestration": ((t_queue - e_queue) - (t_direct - e_direct)) / t_direct,
        # Little's law: the groups' engine seconds over the wall time = the mean number of groups in
        # the engine; its shortfall in the queue leg is the orchestration's idle slots (at c > 1 the
        # groups' times overlap, so this, not the per-group split above, is the orchestration's part)
        "in_flight_direct": e_direct / t_direct,
        "in_flight_queue": e_queue / t_queue,
        "idle_slots": (e_direct / t_direct) / (e_queue / t_queue) - 1,
        "same_tokens": float(tok_direct == tok_queue),
        "tokens": tok_direct,
    }


def start_vllm(tmp: Path, model: Path, eager: bool = False) -> Any:
    """A real vLLM 0.32 server on ``model`` (rollout_svc.engines.vllm_launch; docs/vllm.md)."""
    from rollout_svc.config import VllmSettings
    from rollout_svc.engines.vllm_launch import VLLMServer, vllm_command, vllm_env, vllm_python

    python = vllm_python(VllmSettings().python)
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {python}: run `bash deploy/vllm-setup.sh`")
    cmd = vllm_command(python, model, free_port(), served_name="tiny", eager=eager)
    t0 = time.perf_counter()
    server = VLLMServer(cmd, vllm_env(), tmp / "vllm.log").start(timeout_s=900)
    print(f"  vLLM {'eager' if eager else 'compiled'} started in {time.perf_counter() - t0:.0f} s")
    return server


def bench_vllm_throughput(quick: bool, tmp: Path, eager: bool = False) -> dict[str, float]:
    """Decode tokens/s of a vLLM server and of ``loom engine`` (the torch engine) on the same model,
    the same requests from the same client, at 4 and 16 requests in flight; each pair back to back,
    the order alternating. Requests: 16 prompts x n=8 samples, 96 tokens, temperature 1."""
    from rollout_svc.engines.torch import load_tokenizer, resolve_model_path
    from rollout_svc.engines.vllm import VLLMEngine

    path = resolve_model_path(get_settings().model)
    tok = load_tokenizer(path)
    reqs = plain_requests(tok, 8 if quick else 16, 48 if quick else 96)
    params = [r.sampling.model_copy(update={"n": 8}) for r in reqs]
    threads = str(os.cpu_count() or 1)
    procs = Procs()
    vllm = start_vllm(tmp, path, eager=eager)
    out: dict[str, float] = {"torch_threads": float(threads)}
    try:
        torch_url = start_engine_server(procs, tmp, ["--model", str(path)], LOOM_TORCH_THREADS=threads)

        async def measure(url: str, in_flight: int) -> float:
            engine = VLLMEngine(url, timeout=600)
            slots = asyncio.Semaphore(in_flight)

            async def one(r: RolloutRequest, sp: SamplingParams) -> int:
                async with slots:
                    outs = await engine.generate(list(r.prompt_ids or []), sp)
                    return sum(len(c.token_ids) for c in outs)

            await one(reqs[0], params[0].model_copy(update={"max_tokens": 8}))  # warm
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(r, sp) for r, sp in zip(reqs, params, strict=True))))
            elapsed = time.perf_counter() - t0
            await engine.close()
            return tokens / elapsed

        for k, in_flight in enumerate((4, 16)):
            order = [("vllm", vllm.url), ("torch", torch_url)]
            for name, url in order if k % 2 == 0 else order[::-1]:
                out[f"{name}_{in_flight}"] = asyncio.run(measure(url, in_flight))
            out[f"ratio_{in_flight}"] = out[f"vllm_{in_flight}"] / out[f"torch_{in_flight}"]
    finally:
        procs.close()
        vllm.stop()
    return out


def bench_prefill(quick: bool) -> dict[str, float]:
    from rollout_svc.engines.torch import TorchEngine, resolve_model_path
    from rollout_svc.rollout import generate_group
    from zoo.tiny import STREAM_HEADER, make_problems
    from zoo.tiny.traces import stream_sentences

    settings = get_settings()
    path = resolve_model_path(settings.model)
    reuse = TorchEngine(path, cache_entries=32)
    naive = TorchEngine(path, cache_entries=0, model=reuse.model, tokenizer=reuse.tokenizer)
    problems = make_problems("arith", 4 if quick else 12, seed=11)
    out: dict[str, float] = {}
    for name, engine in (("reuse", reuse), ("naive", naive)):
        length = 0
        for i, p in enumerate(problems):
            req = RolloutRequest(
                mode="streaming",
                prompt=STREAM_HEADER,
                sampling=SamplingParams(n=2, max_tokens=96, seed=i, temperature=1.0),
                mode_params={"sentences": stream_sentences(p), "segment_cap": 32, "answer_max_tokens": 16},
            )
            group = asyncio.run(generate_group(req, engine, lambda e=engine: e.tokenizer, settings))
            length += sum(len(t.prompt_ids) + len(t.completion_ids) for t in group.trajectories)
        computed = engine.stats.prefill_tokens + engine.stats.decode_tokens
        out[f"{name}_computed"] = computed
        out[f"{name}_ratio"] = computed / length
        out[f"{name}_prefill_ratio"] = engine.stats.prefill_tokens / length
        out["final_tokens"] = length
    return out


def bench_scaling(quick: bool, tmp: Path) -> dict[int, float]:
    rabbit = reachable(5672) and reachable(6379)
    ms, max_tokens, per_worker = 10.0, 100, 4 if quick else 8  # 1 s of simulated generation per group
    out: dict[int, float] = {}
    for k in (1, 2, 4, 8):
        procs = Procs()
        try:
            # the workers wait for their engines (the client retries), so the k servers start at once
            sim = ["--simulate-ms-per-token", str(ms)]
            urls = [start_engine_server(procs, tmp, sim, wait=False) for _ in range(k)]
            base = queue_env(tmp / f"s{k}", rabbit, LOOM_ENGINE="vllm")
            logs = []
            for i, url in enumerate(urls):
                log = tmp / f"scale-{k}-{i}.log"
                env = {**base, "LOOM_ENGINE_URL": url}
                argv = [
                    sys.executable,
                    "-m",
                    "launch.cli",
                    "worker",
                    "rollout",
                    "-c",
                    "1",
                    "-n",
                    f"s{k}-{i}@%h",
                ]
                procs.start(argv, env, log)
                logs.append(log)
            deadline = time.monotonic() + 300
            while not all(" ready." in x.read_text(errors="replace") for x in logs):
                if time.monotonic() > deadline:
                    raise RuntimeError("scaling workers did not start")
                time.sleep(0.2)
            app = celery_for(base)
            reqs = [
                RolloutRequest(
                    group_id=f"scale-{uuid.uuid4().hex[:8]}",
                    prompt_ids=[1, 2, 3, 4],
                    sampling=SamplingParams(n=4, max_tokens=max_tokens, seed=i),
                )
                for i in range(k * (per_worker + 1))
            ]
            run_through_queue(app, reqs[:k])  # warm every worker's engine client
            elapsed, _, _ = run_through_queue(app, reqs[k:])
            out[k] = k * per_worker / elapsed
            app.close()
            print(f"  scaling: {k} workers: {out[k]:.2f} groups/s ({'rabbitmq' if rabbit else 'embedded'})")
        finally:
            procs.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="overhead,prefill,scaling")
    p.add_argument("--pools", default="threads", help="rollout worker pools to measure: threads,prefork")
    p.add_argument("--brokers", default="embedded,rabbitmq")
    p.add_argument(
        "--engines",
        default="process,in-process,server",
        help="process (the torch engine in a child process of the worker / the bench process: the "
        "default), in-process (inside them: LOOM_ENGINE_PROCESS=false) and server (loom engine)",
    )
    p.add_argument(
        "--concurrency",
        default="1,4",
        help="groups in flight per leg: 1 (each task's gaps fully exposed) and 4 (a replica kept busy)",
    )
    p.add_argument(
        "--ready",
        type=int,
        default=-1,
        help="LOOM_ROLLOUT_READY of the worker (-1: its default, as many as run with an engine server "
        "or process, none in-process)",
    )
    p.add_argument("--vllm-eager", action="store_true", help="start vLLM with --enforce-eager (faster start)")
    p.add_argument(
        "--timeline", action="store_true", help="split each queue leg's groups by the workers' marks"
    )
    args = p.parse_args(argv)
    configure_process()
    only = set(args.only.split(","))
    rows: list[tuple[str, str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="loom-bench-rollout-") as d:
        tmp = Path(d)
        if args.timeline:
            global TIMELINE
            from loom import timeline

            TIMELINE = tmp / "timeline.jsonl"
            timeline.PATH = str(TIMELINE)
        if "overhead" in only:
            wanted = args.brokers.split(",")
            brokers = [("embedded", False)] if "embedded" in wanted else []
            brokers += [("RabbitMQ", True)] if "rabbitmq" in wanted and reachable(5672) else []
            combos = [
                (b, p, int(c), e)
                for e in args.engines.split(",")
                for c in args.concurrency.split(",")
                for p in args.pools.split(",")
                for b in brokers
            ]
            for (label, rabbit), pool, conc, eng in combos:
                o = bench_overhead(args.quick, tmp, rabbit, pool, conc, eng, args.ready)
                label = f"{label}, {pool} pool, {conc} in flight, {eng} engine"
                rows.append(
                    (
                        f"orchestration overhead (plain, {label})",
                        f"direct {o['direct_s']:.2f}s | queue {o['queue_s']:.2f}s ({o['groups']} groups,"
                        f" {int(o['tokens'])} tok, same tokens: {bool(o['same_tokens'])})",
                        f"{100 * o['overhead']:+.1f} % (median pair {100 * o['median_overhead']:+.1f} %)",
                        "<= 5 %",
                    )
                )
                if conc > 1:  # the groups' engine times overlap: split by groups in the engine instead
                    rows.append(
                        (
                            "  of which idle engine slots",
                            f"groups in the engine: direct {o['in_flight_direct']:.2f} | queue "
                            f"{o['in_flight_queue']:.2f} of {conc}; engine time per group queue/direct "
                            f"{100 * o['engine_ratio']:+.1f} % (same tokens: machine noise)",
                            f"{100 * o['idle_slots']:+.1f} %",
                            "-",
                        )
                    )
                    continue
                rows.append(
                    (
                        "  of which outside the engine",
                        f"{o['orchestration_ms']:.1f} ms per group; engine time queue/direct"
                        f" {100 * o['engine_ratio']:+.1f} % (same tokens: machine noise)",
                        f"{100 * o['orchestration']:+.1f} %",
                        "<= 5 %",
                    )
                )
        if "vllm" in only:
            wanted = args.brokers.split(",")
            brokers = [("embedded", False)] if "embedded" in wanted else []
            brokers += [("RabbitMQ", True)] if "rabbitmq" in wanted and reachable(5672) else []
            for (label, rabbit), conc in [(b, int(c)) for c in args.concurrency.split(",") for b in brokers]:
                o = bench_overhead(
                    args.quick, tmp, rabbit, "threads", conc, "vllm", args.ready, args.vllm_eager
                )
                rows.append(
                    (
                        f"orchestration overhead (plain, vLLM 0.32, {label}, {conc} in flight)",
                        f"direct {o['direct_s']:.2f}s | queue {o['queue_s']:.2f}s ({o['groups']} groups,"
                        f" {int(o['tokens'])} tok, same tokens: {bool(o['same_tokens'])})",
                        f"{100 * o['overhead']:+.1f} % (median pair {100 * o['median_overhead']:+.1f} %)",
                        "<= 5 %",
                    )
                )
                print(" | ".join(rows[-1]), f"| idle slots {100 * o['idle_slots']:+.1f} %", flush=True)
            t = bench_vllm_throughput(args.quick, tmp, args.vllm_eager)
            for n in (4, 16):
                rows.append(
                    (
                        f"vLLM / torch engine tokens/s, {n} in flight",
                        f"vLLM {t[f'vllm_{n}']:.0f} tok/s | torch ({int(t['torch_threads'])} threads) "
                        f"{t[f'torch_{n}']:.0f} tok/s",
                        f"{t[f'ratio_{n}']:.2f}x",
                        "-",
                    )
                )
        if "prefill" in only:
            r = bench_prefill(args.quick)
            rows.append(
                (
                    "streaming computed tokens / final length",
                    f"reuse {r['reuse_ratio']:.3f}x | naive {r['naive_ratio']:.2f}x"
                    f" ({int(r['final_tokens'])} tok)",
                    f"{r['reuse_ratio']:.3f}x",
                    "<= 1.15x",
                )
            )
            rows.append(
                (
                    "streaming prompt prefill / final length",
                    f"reuse {r['reuse_prefill_ratio']:.3f}x | naive {r['naive_prefill_ratio']:.2f}x",
                    f"{r['reuse_prefill_ratio']:.3f}x",
                    "-",
                )
            )
        if "scaling" in only:
            s = bench_scaling(args.quick, tmp)
            eff = {k: s[k] / (k * s[1]) for k in s}
            detail = " | ".join(f"{k}w {s[k]:.2f}/s ({eff[k]:.2f})" for k in sorted(s))
            rows.append(
                ("replica scaling (SIMULATED engine)", detail, f"{eff[8]:.2f}x linear at 8", ">= 0.85x")
            )
    print()
    print(f"{'benchmark':<42} {'measured side by side':<70} {'result':<22} target")
    for name, detail, result, target in rows:
        print(f"{name:<42} {detail:<70} {result:<22} {target}")
    if TIMELINES:
        print("\nqueue legs in order (the warm-up first in each configuration): ms median / max per group")
        for tl in TIMELINES:
            spans = " | ".join(f"{n} {tl[n][0]}/{tl[n][1]}" for n, _, _ in _SPANS if n in tl)
            print(f"  {tl['groups']} groups, {tl['leg_s']} s: {spans}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
