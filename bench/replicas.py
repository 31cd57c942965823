"""Past one machine, in simulation: the real gateway and RabbitMQ with 100+ simulated rollout replicas
and 10+ keys, each key submitting jobs (docs/benchmarks/replicas.md, docs/operations.md "Scaling").

What runs, all real but the engine:
- the gateway (``loom api gateway``, its HTTP API, its job loop: gateway/jobs.py, gateway/pipeline.py);
- RabbitMQ (127.0.0.1:5672) and the Redis result store (127.0.0.1:6379), queues namespaced per run;
- ``--workers`` rollout workers (``loom worker rollout -c SLOTS``, the threads pool), each calling its
  own ``loom engine --simulate-ms-per-token`` server: SIMULATION, random tokens after a fixed latency
  (rollout_svc/engines/simulated.py), requests that do not slow each other down;
- one reward worker scoring every group (``format_think``: a rule, so the reward tier is not what is
  measured).

One REPLICA here is one engine slot of a rollout worker: it generates one group at a time, and a group
takes ``ms-per-token x max_tokens`` (the simulated engine's sleep). ``--workers W --slots S`` is W x S
replicas; a real vLLM replica batches many groups, so a simulated replica stands for one group's share
of one. Each of ``--keys`` keys keeps ``--jobs`` jobs of ``--prompts`` prompts in flight (a finished
job is replaced at once: equal demand), and polls them through ``GET /v1/jobs/{id}?limit=1``.

Two phases on the same processes (``--phases``): ``replica`` (groups of ``--slow-tokens`` tokens:
the replicas are the limit, a backlog waits in the rollout queue, which is where fairness across keys
matters) and ``pipeline`` (groups of ``--fast-tokens`` tokens: replicas idle faster than the rest can
feed them, so the first limit is elsewhere). Each phase prints groups/s, the queue depths over time
(passive queue declares), per-key groups/s and Jain's index, the CPU every process used (per-process
CPU time; RabbitMQ's and Redis's servers are shared with other users of the machine) and Redis's
commands per group, and names the first bottleneck by a stated rule (``bottleneck``).

``--weights 1,2,...`` gives the keys weights (the gateway's fair share, gateway/scheduler.py: the
weight is a LOOM_API_KEYS entry's fourth field); per-key throughput is then printed against weight.

    python bench/replicas.py [--workers 4 --slots 32 --keys 12 --jobs 2 --prompts 16]
        [--phases replica,pipeline] [--seconds 60] [--warmup 15] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import rollout as rollout_bench  # noqa: E402
from bench.rollout import free_port, reachable  # noqa: E402

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
REDIS_DB = 6
REDIS = f"redis://127.0.0.1:6379/{REDIS_DB}"
READY_S = 300.0  # a loaded 2-core machine: imports alone can take a minute per process
ENDED = ("succeeded", "failed", "cancelled")


def jain(xs: list[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one has all."""
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else 0.0


class Procs:
    """The bench's child processes (``launch.cli`` roles, bench/rollout.py's ``Procs``: each in its
    own session, all killed on exit), by role, each with its log."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.children = rollout_bench.Procs()
        self.roles: dict[str, subprocess.Popen] = {}

    def start(self, role: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        p = self.children.start([sys.executable, "-m", "launch.cli", *argv], env, self.logs / f"{role}.log")
        self.roles[role] = p
        return p

    def log(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text(errors="replace")

    def close(self) -> None:
        self.children.close()


def key_of(i: int) -> tuple[str, str]:
    """Key ``i``'s name and secret."""
    return f"k{i:02d}", f"loom_bench_replicas_{i:02d}"


def key_entries(weights: list[float]) -> str:
    """LOOM_API_KEYS for one key per weight; a weight other than 1 as the entry's fourth field
    (``name:sha256hex:scopes:weight``, gateway/keys.py)."""
    out = []
    for i, w in enumerate(weights):
        name, secret = key_of(i)
        entry = f"{name}:{hashlib.sha256(secret.encode()).hexdigest()}"
        out.append(entry if w == 1.0 else f"{entry}:jobs+runs:{w:g}")
    return ",".join(out)


def base_env(data_dir: Path, namespace: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOOM_")}
    env.update(
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        LOOM_TORCH_THREADS="1",
        LOOM_DATA_DIR=str(data_dir),
        LOOM_BROKER_URL=RABBITMQ,
        LOOM_RESULT_BACKEND=REDIS,
        LOOM_QUEUE_NAMESPACE=namespace,
    )
    return env


def wait_until(what: str, ok: Any, procs: Procs, role: str) -> None:
    deadline = time.monotonic() + READY_S
    while not ok():
        p = procs.roles[role]
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start:\n{procs.log(role)[-3000:]}")
        time.sleep(0.3)


def start_stack(args: argparse.Namespace, procs: Procs, env: dict[str, str], weights: list[float]) -> str:
    """Engines, rollout workers, the reward worker and the gateway, started at once; the gateway's URL
    once every process is ready."""
    ms = args.group_ms / args.slow_tokens  # ms a token: a slow group takes group_ms
    engines = [free_port() for _ in range(args.workers)]
    for i, port in enumerate(engines):
        argv = ["engine", "--host", "127.0.0.1", "--port", str(port), "--simulate-ms-per-token", f"{ms}"]
        procs.start(f"engine{i}", argv, env)
    for i, port in enumerate(engines):
        wenv = {**env, "LOOM_ENGINE": "vllm", "LOOM_ENGINE_URL": f"http://127.0.0.1:{port}"}
        argv = ["worker", "rollout", "-c", str(args.slots), "-n", f"replicas{i}-{uuid.uuid4().hex[:4]}@%h"]
        procs.start(f"rollout{i}", argv, wenv)
    procs.start(
        "reward",
        ["worker", "reward", "-c", str(args.reward_slots), "-n", f"reward-{uuid.uuid4().hex[:4]}@%h"],
        env,
    )
    gport = free_port()
    genv = {
        **env,
        "LOOM_API_KEYS": key_entries(weights),
        # what the replicas take at once (each worker's pool: its slots and as many ready beside them,
        # rollout_svc/config.py rollout_slots): the fair share's window (gateway/scheduler.py)
        "LOOM_GATEWAY_ROLLOUT_SLOTS": str(args.workers * 2 * args.slots),
        "LOOM_GATEWAY_RATE": "10000",
        "LOOM_GATEWAY_BURST": "10000",
    }
    procs.start("gateway", ["api", "gateway", "--host", "127.0.0.1", "--port", str(gport)], genv)
    for i in range(args.workers):
        wait_until(
            f"rollout worker {i}", lambda i=i: " ready." in procs.log(f"rollout{i}"), procs, f"rollout{i}"
        )
    wait_until("the reward worker", lambda: " ready." in procs.log("reward"), procs, "reward")
    for i, port in enumerate(engines):
        wait_until(f"engine {i}", lambda port=port: reachable(port), procs, f"engine{i}")
    wait_until("the gateway", lambda: reachable(gport), procs, "gateway")
    return f"http://127.0.0.1:{gport}"


# ------------------------------------------------------------------------------------- measuring


@dataclass
class Sample:
    t: float
    done: list[int]  # groups stored per key so far (this phase)
    rollout: int | None  # messages ready in the rollout queue
    reward: int | None


class Meter:
    """CPU seconds of each process (ours, RabbitMQ's and Redis's servers) and Redis's command count,
    read at the start and the end of a phase's measured window."""

    def __init__(self, procs: Procs) -> None:
        self.procs: dict[str, psutil.Process] = {r: psutil.Process(p.pid) for r, p in procs.roles.items()}
        self.procs["bench"] = psutil.Process()
        servers = {"beam.smp": ("rabbitmq", 5672), "redis-server": ("redis", 6379)}
        for p in psutil.process_iter(["name"]):
            role, port = servers.get(p.info["name"], ("", 0))
            if role and listens(p, port):  # the server the stack uses (tests start private nodes too)
                self.procs[role] = p

    def cpu(self) -> dict[str, float]:
        out = {}
        for role, p in self.procs.items():
            try:
                t = p.cpu_times()  # children included: a worker's or engine's own child processes
                out[role] = t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                out[role] = float("nan")
        t = psutil.cpu_times()  # every process's, niced ones included
        out["machine"] = t.user + t.nice + t.system + t.irq + t.softirq
        return out

    @staticmethod
    def redis_commands() -> int:
        import redis

        return int(redis.Redis.from_url(REDIS).info("stats")["total_commands_processed"])


def listens(p: psutil.Process, port: int) -> bool:
    try:
        return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp"))
    except psutil.Error:
        return False


def queue_app(env: dict[str, str]) -> Any:
    from loom.contracts.settings import Settings
    from loom.queue import make_celery

    values = {k[len("LOOM_") :].lower(): v for k, v in env.items() if k.startswith("LOOM_")}
    return make_celery("gateway", Settings(**values))


@dataclass
class Phase:
    name: str
    max_tokens: int
    group_s: float  # the simulated engine's time per group
    seconds: float  # the measured window
    groups: int  # groups stored in the window, all keys
    per_key: list[int]
    weights: list[float]
    jobs_finished: int
    jobs_failed: int
    http_retries: int  # requests of the keys sent again after a dropped connection
    requests: int  # the keys' requests to the gateway in the window (submissions, polls, cancels)
    groups_per_s: float
    capacity_per_s: float  # replicas / group_s
    utilization: float
    jain: float
    share_vs_weight: list[float]  # each key's share of the groups over its share of the weights
    cpu_s: dict[str, float]
    redis_commands: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    bottleneck: str = ""


class Driver:
    """Every key keeps ``jobs`` jobs in flight; a finished job is replaced at once."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url, self.args = url, args
        self.done = [0] * args.keys  # groups stored, by key, since the phase began
        self.finished = self.failed = self.retries = self.requests = 0
        self.stop = asyncio.Event()

    def job_body(self, key: int, seq: int, max_tokens: int) -> dict[str, Any]:
        prompts = [f"{(key * 7 + seq + p) % 90 + 10}+{p + 11}=" for p in range(self.args.prompts)]
        return {
            "job_key": f"{uuid.uuid4().hex[:8]}-{seq}",
            "prompts": prompts,
            "sampling": {"n": self.args.n, "max_tokens": max_tokens, "temperature": 1.0, "seed": seq},
            "reward": {"components": [{"name": "format_think"}]},
        }

    async def call(self, client: httpx.AsyncClient, method: str, path: str, **kw: Any) -> httpx.Response:
        """One request, sent again on a dropped connection (a GET, a cancel, and a submission, which
        its ``job_key`` makes idempotent); the retries are counted and reported."""
        for attempt in range(5):
            try:
                self.requests += 1
                return await client.request(method, path, **kw)
            except httpx.TransportError:
                self.retries += 1
                if attempt == 4:
                    raise
                await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    async def one_slot(self, client: httpx.AsyncClient, key: int, slot: int, max_tokens: int) -> None:
        seq = slot
        while not self.stop.is_set():
            r = await self.call(client, "POST", "/v1/jobs", json=self.job_body(key, seq, max_tokens))
            if r.status_code != 201:
                raise RuntimeError(f"key {key}: submit answered {r.status_code}: {r.text[:500]}")
            job_id, seen = r.json()["id"], 0
            while True:
                await asyncio.sleep(self.args.poll)
                v = (await self.call(client, "GET", f"/v1/jobs/{job_id}", params={"limit": 1})).json()
                self.done[key] += v["n_done"] - seen
                seen = v["n_done"]
                if v["status"] in ENDED:
                    self.finished += 1
                    self.failed += v["status"] != "succeeded"
                    if v["status"] == "failed":
                        print(f"  job {job_id} of k{key:02d} failed: {v.get('error')}", flush=True)
                    break
                if self.stop.is_set():  # the phase is over: cancel what is left, counted as done so far
                    await self.call(client, "POST", f"/v1/jobs/{job_id}/cancel")
                    return
            seq += self.args.jobs

    async def run(self, max_tokens: int) -> None:
        tasks = []
        clients = []
        for key in range(self.args.keys):
            _, secret = key_of(key)
            c = httpx.AsyncClient(
                base_url=self.url, headers={"Authorization": f"Bearer {secret}"}, timeout=60
            )
            clients.append(c)
            tasks += [
                asyncio.create_task(self.one_slot(c, key, s, max_tokens)) for s in range(self.args.jobs)
            ]
        try:
            await asyncio.gather(*tasks)
        finally:
            for c in clients:
                await c.aclose()


def run_phase(
    warm: Callable[[], bool],
    name: str,
    max_tokens: int,
    args: argparse.Namespace,
    url: str,
    meter: Meter,
    qapp: Any,
    weights: list[float],
) -> Phase:
    from loom.queue import queue_depths

    driver = Driver(url, args)
    samples: list[Sample] = []
    marks: dict[str, Any] = {}
    loops: list[asyncio.AbstractEventLoop] = []
    t0 = time.monotonic()

    def sampler() -> None:  # queue depths and per-key counts every second, in a thread of its own
        while not driver.stop.is_set():
            try:
                d = queue_depths(qapp, ("rollout", "reward"))
            except Exception:  # the broker did not answer this time: the sample says so
                d = {}
            now = time.monotonic() - t0
            samples.append(Sample(round(now, 1), list(driver.done), d.get("rollout"), d.get("reward")))
            if "warm" not in marks and warm():
                marks["warm"] = now  # the window begins --warmup s after every worker is warm
            if "start" not in marks and "warm" in marks and now >= marks["warm"] + args.warmup:
                marks["start"] = (
                    now,
                    list(driver.done),
                    meter.cpu(),
                    meter.redis_commands(),
                    driver.requests,
                )
            if "start" not in marks and now > READY_S:
                marks["error"] = f"not every worker had finished a task after {READY_S:.0f} s"
                loops[0].call_soon_threadsafe(driver.stop.set)
                return
            if "start" in marks and now >= marks["start"][0] + args.seconds:
                marks["end"] = (now, list(driver.done), meter.cpu(), meter.redis_commands(), driver.requests)
                loops[0].call_soon_threadsafe(driver.stop.set)
                return
            time.sleep(1.0)

    async def main() -> None:
        loops.append(asyncio.get_running_loop())
        threading.Thread(target=sampler, daemon=True).start()
        await driver.run(max_tokens)

    asyncio.run(main())
    if "error" in marks:
        raise RuntimeError(marks["error"])
    (ts, d0, c0, r0, q0), (te, d1, c1, r1, q1) = marks["start"], marks["end"]
    window = te - ts
    per_key = [b - a for a, b in zip(d0, d1, strict=True)]
    groups = sum(per_key)
    group_s = args.group_ms / 1000.0 * max_tokens / args.slow_tokens
    replicas = args.workers * args.slots
    capacity = replicas / group_s
    rate = groups / window
    wsum, gsum = sum(weights), max(groups, 1)
    phase = Phase(
        name=name,
        max_tokens=max_tokens,
        group_s=group_s,
        seconds=window,
        groups=groups,
        per_key=per_key,
        weights=weights,
        jobs_finished=driver.finished,
        jobs_failed=driver.failed,
        http_retries=driver.retries,
        requests=q1 - q0,
        groups_per_s=rate,
        capacity_per_s=capacity,
        utilization=rate / capacity,
        jain=jain([x / w for x, w in zip(per_key, weights, strict=True)]),
        share_vs_weight=[(x / gsum) / (w / wsum) for x, w in zip(per_key, weights, strict=True)],
        cpu_s={k: c1[k] - c0[k] for k in c1},
        redis_commands=r1 - r0,
        samples=[asdict(s) for s in samples],
    )
    phase.bottleneck = bottleneck(phase, args)
    return phase


# Where a process's CPU tops out: a Python process (one GIL) or Redis (one thread) at one core; the
# broker and the machine at the machine's cores.
ONE_CORE = ("gateway", "redis")


def warmed(procs: Procs) -> bool:
    """Every worker has finished a task: its first one imports the engine client and the tokenizer
    (40 s measured on the loaded machine), which no measured window should hold."""
    workers = [r for r in procs.roles if r.startswith(("rollout", "reward"))]
    return all(" succeeded in " in procs.log(r) for r in workers)


def bottleneck(ph: Phase, args: argparse.Namespace) -> str:
    """The first limit, by rule: the replicas when they are busy >= 90 % of the window; else the
    machine when its CPU is >= 90 % of its cores; else the one-core process nearest its core. Always
    with each tier's CPU-ms per group, which says where the limit moves once there are more cores."""
    cores = psutil.cpu_count() or 1
    busy = {k: v / ph.seconds for k, v in ph.cpu_s.items()}  # cores used
    per_group = {k: 1e3 * v / max(ph.groups, 1) for k, v in tiers(ph.cpu_s).items()}
    costs = ", ".join(f"{k} {v:.1f}" for k, v in sorted(per_group.items(), key=lambda kv: -kv[1]))
    top = max((t for t in per_group if t != "machine"), key=lambda t: per_group[t])
    if ph.utilization >= 0.9:
        return f"the replicas (busy {ph.utilization:.0%} of the window); CPU-ms per group: {costs}"
    if busy["machine"] >= 0.9 * cores:
        return (
            f"the machine's {cores} cores ({busy['machine']:.2f} busy); of Loom's tiers {top} costs the most "
            f"CPU a group; CPU-ms per group: {costs}"
        )
    near = max(ONE_CORE, key=lambda k: busy.get(k, 0.0))
    return f"{near} at {busy.get(near, 0.0):.2f} of its one core; CPU-ms per group: {costs}"


def tiers(cpu_s: dict[str, float]) -> dict[str, float]:
    """CPU seconds by tier: the rollout workers, the engines, each server, the driver, the machine."""
    out: dict[str, float] = {}
    for role, s in cpu_s.items():
        tier = role.rstrip("0123456789")
        out[tier] = out.get(tier, 0.0) + s
    return out


def report(ph: Phase, args: argparse.Namespace) -> None:
    print(f"\n== phase {ph.name}: groups of {ph.max_tokens} tokens, {ph.group_s:.2f} s each on a replica")
    print(f"groups/s {ph.groups_per_s:.2f} over {ph.seconds:.0f} s ({ph.groups} groups); capacity of the "
          f"replicas {ph.capacity_per_s:.1f}/s; replica utilization {ph.utilization:.2f}")  # fmt: skip
    print(f"jobs finished {ph.jobs_finished} ({ph.jobs_failed} failed); requests sent again after a dropped "
          f"connection: {ph.http_retries}; the keys' requests in the window {ph.requests} "
          f"({ph.requests / max(ph.groups, 1):.2f} a stored group)")  # fmt: skip
    print("queue depth (messages ready) over time: t s | rollout | reward")
    step = max(1, len(ph.samples) // 16)
    for s in ph.samples[::step]:
        print(f"  {s['t']:6.1f} | {s['rollout']} | {s['reward']}")
    rates = [x / ph.seconds for x in ph.per_key]
    print("per-key groups/s: " + " ".join(f"k{i:02d}={r:.2f}" for i, r in enumerate(rates)))
    print(f"Jain's fairness index across keys (throughput / weight): {ph.jain:.3f}")
    if len(set(ph.weights)) > 1:
        pairs = zip(ph.weights, ph.share_vs_weight, strict=True)
        print("share of groups / share of weight: " + " ".join(
            f"k{i:02d}(w={w:g})={s:.2f}" for i, (w, s) in enumerate(pairs)
        ))  # fmt: skip
    cores = psutil.cpu_count() or 1
    print(f"CPU in the window (cores used; the machine has {cores}; rabbitmq and redis are shared servers):")
    for tier, s in sorted(tiers(ph.cpu_s).items(), key=lambda kv: -kv[1]):
        print(f"  {tier:<9} {s / ph.seconds:5.2f} cores  {1e3 * s / max(ph.groups, 1):6.1f} CPU-ms/group")
    print(f"result store: {ph.redis_commands / ph.seconds:.0f} Redis commands/s, "
          f"{ph.redis_commands / max(ph.groups, 1):.1f} per group (all of the server's clients)")  # fmt: skip
    print(f"first bottleneck: {ph.bottleneck}")


def main(argv: list[str] | None = None) -> list[Phase]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4, help="rollout worker processes (one engine each)")
    p.add_argument("--slots", type=int, default=32, help="replicas (engine slots) per worker")
    p.add_argument("--keys", type=int, default=12)
    p.add_argument("--jobs", type=int, default=2, help="jobs each key keeps in flight")
    p.add_argument("--prompts", type=int, default=16, help="prompts a job (the gateway runs 8 at once)")
    p.add_argument("--reward-slots", type=int, default=4, help="the reward worker's tasks at once")
    p.add_argument("--n", type=int, default=4, help="samples a group")
    p.add_argument("--group-ms", type=float, default=4000.0, help="a slow group's time on its replica")
    p.add_argument("--slow-tokens", type=int, default=64)
    p.add_argument("--fast-tokens", type=int, default=4)
    p.add_argument("--phases", default="replica,pipeline")
    p.add_argument("--seconds", type=float, default=60.0, help="each phase's measured window")
    p.add_argument(
        "--warmup", type=float, default=15.0, help="seconds between every worker being warm and the window"
    )
    p.add_argument("--poll", type=float, default=1.0, help="how often a key polls each of its jobs")
    p.add_argument("--weights", default="", help="comma-separated weight per key (default: all 1)")
    p.add_argument("--json", default="", help="write the phases here")
    p.add_argument("--logs", default="", help="keep every process's log in this folder")
    args = p.parse_args(argv)
    if not (reachable(5672) and reachable(6379)):
        raise SystemExit("bench/replicas.py needs RabbitMQ on 127.0.0.1:5672 and Redis on 127.0.0.1:6379")
    weights = [float(w) for w in args.weights.split(",")] if args.weights else [1.0] * args.keys
    if len(weights) != args.keys:
        raise SystemExit(f"--weights: {len(weights)} weights for {args.keys} keys")
    replicas = args.workers * args.slots
    print(f"replicas: {replicas} ({args.workers} rollout worker processes x {args.slots} engine slots; one "
          f"replica = one slot generating one group at a time on a SIMULATED engine)")  # fmt: skip
    print(f"keys: {args.keys}, each with {args.jobs} jobs of {args.prompts} prompts (n={args.n}) in flight; "
          f"load at start: {os.getloadavg()}")  # fmt: skip
    namespace = f"loombench-{uuid.uuid4().hex[:8]}-"
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory() as d:
        logs = Path(args.logs) if args.logs else Path(d) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        procs = Procs(logs)
        env = base_env(Path(d) / "data", namespace)
        qapp = queue_app(env)
        try:
            t = time.monotonic()
            url = start_stack(args, procs, env, weights)
            print(f"stack ready in {time.monotonic() - t:.0f} s")
            meter = Meter(procs)
            tokens = {"replica": args.slow_tokens, "pipeline": args.fast_tokens}
            for name in args.phases.split(","):
                ph = run_phase(lambda: warmed(procs), name, tokens[name], args, url, meter, qapp, weights)
                report(ph, args)
                phases.append(ph)
        finally:
            procs.close()
            delete_queues(qapp, namespace)
            qapp.close()
    print(f"load at end: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(x) for x in phases], indent=1))
    return phases


def delete_queues(app: Any, namespace: str) -> None:
    """The run's namespaced queues and exchanges, deleted (other users share this RabbitMQ)."""
    from loom.queue import QUEUES

    try:
        with app.connection_for_write() as conn:
            ch = conn.channel()
            for q in QUEUES:
                for call in (ch.queue_delete, ch.exchange_delete):
                    try:
                        call(f"{namespace}{q}")
                    except Exception:
                        ch = conn.channel()
    except Exception as exc:
        print(f"could not delete the queues of {namespace}: {exc}")


if __name__ == "__main__":
    main()
