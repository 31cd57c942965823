"""The TRL adapter's overhead (issue 34): TRL's rollouts through Loom against TRL generating itself.

Two ways a TRL 1.16 ``GRPOTrainer`` step gets its completions, on the same machine, the same torch
engine (the built-in tiny model, one torch thread per process, as every Loom process runs it):

- **loom**: ``loom.clients.trl_rollout.LoomRolloutFunc`` in plain mode, called as TRL calls its
  ``rollout_func`` (each prompt ``num_generations`` times in a row), against a local stack (gateway,
  rollout and reward workers, the embedded broker): one gateway job per call, its groups read from the
  job's event stream, every sample rewarded by the job's spec (accuracy).
- **trl**: TRL's own ``VLLMClient.generate`` (trl/generation/vllm_client.py, the request
  ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` makes each step: the distinct prompts' token ids,
  ``n = num_generations``) against ``loom engine --model tiny`` started with
  ``VLLM_SERVER_DEV_MODE=1``. ``VLLMClient`` refuses to build without the ``vllm`` package; only that
  install check is bypassed (as tests/interop/engine/test_trl_vllm_client.py does).

Equal work: the same prompts, ``n``, ``max_tokens`` and temperature, ``ignore_eos`` on both sides so
every completion is ``max_tokens`` long (the tokens each side generated are counted and printed).
The repetitions alternate (loom, trl, trl, loom, ...) after one warm-up call of each; the overhead is
median(loom) / median(trl) - 1, and per repetition loom / trl - 1 of its two calls (the median of
those pairs is printed too). ``--profile`` breaks one Loom call down: the job's submission, the
first and the last group's arrival on the stream, and the adapter's own work after it. ``--timeline``
runs the stack with ``LOOM_TIMELINE`` (loom/timeline.py) and prints the worker-side timeline of the
calls after the repetitions: per stage (gateway publish, rollout task start, engine call, engine
admits and batch end, reward task, result read, group stored, event sent) the first and last of the
call's groups, in seconds after the call began, and the claims and starts of the batched reward tasks
(``reward.score_groups``); then N TRL calls with their engine server's own marks, and the median
engine span (first admit to last batch end) of each side: a longer span on Loom's side is its
engine's decode slowed by what runs beside it, the rest of a call's excess is its hops. Publishing
is left out of both (TRL's server mode moves weights over NCCL, which has no CPU form).

    python bench/trl_overhead.py [--prompts 8] [--group 8] [--max-tokens 96] [--reps 6]
                                 [--concurrency 8] [--profile] [--timeline N] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _BENCH]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float) -> None:
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


def _trainer(args: argparse.Namespace) -> Any:
    """What ``LoomRolloutFunc`` reads of the ``GRPOTrainer`` calling it (state, sampling settings)."""
    return SimpleNamespace(
        state=SimpleNamespace(global_step=0),
        num_generations=args.group,
        num_generations_eval=args.group,
        model=SimpleNamespace(training=True),
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        processing_class=None,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from trl.generation import vllm_client as trl_vllm

    from launch.stack import Stack
    from loom.clients.trl_rollout import LoomRolloutFunc
    from loom.contracts.settings import Settings
    from zoo.tiny import load_tokenizer, plain_prompt, tiny_problems

    problems = tiny_problems("arith", args.prompts, args.seed, "train")
    texts = [plain_prompt(p) for p in problems]
    tasks = {plain_prompt(p): {"label": p.gold, "task": "arithmetic"} for p in problems}
    tok = load_tokenizer()
    prompt_ids = [tok(t)["input_ids"] for t in texts]
    repeated = [t for t in texts for _ in range(args.group)]
    trainer = _trainer(args)

    load_start = os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="loom-trl-overhead-"))
    ports: dict[str, Any] = {
        f"{svc}_port": _free_port() for svc in ("gateway", "rollout", "reward", "reflect", "learner")
    }
    key = "loom_" + secrets.token_urlsafe(24)
    keys = f"trainer:{hashlib.sha256(key.encode()).hexdigest()}:jobs+policy"
    embedded: dict[str, Any] = {"broker_url": "embedded", "result_backend": "embedded"}
    settings = Settings(data_dir=tmp, api_keys=keys, **embedded, **ports)
    engine_port = _free_port()
    engine_env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "LOOM_TORCH_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "LOOM_DATA_DIR": str(tmp / "engine"),
    }
    engine_timeline = tmp / "engine-timeline.jsonl"  # TRL's server: its admits and batch ends
    if args.timeline:
        engine_env["LOOM_TIMELINE"] = str(engine_timeline)
    engine_log = open(tmp / "engine.log", "w")  # noqa: SIM115 - closed below
    engine = subprocess.Popen(
        [sys.executable, "-m", "launch", "engine", "--model", "tiny", "--port", str(engine_port)],
        env=engine_env,
        stdout=engine_log,
        stderr=subprocess.STDOUT,
        cwd=_BENCH.parent,
    )
    stack_env = {"LOOM_ROLLOUT_CONCURRENCY": str(args.concurrency)}
    if args.reward_concurrency:  # only the reward worker reads it in this stack (gateway: no worker)
        stack_env["LOOM_WORKER_CONCURRENCY"] = str(args.reward_concurrency)
    timeline_file = tmp / "timeline.jsonl"
    if args.timeline:
        stack_env["LOOM_TIMELINE"] = str(timeline_file)
    try:
        with Stack(settings, services=("gateway", "rollout", "reward"), env=stack_env, ready_timeout=300):
            engine_url = f"http://127.0.0.1:{engine_port}"
            _wait_http(f"{engine_url}/health", 300)
            trl_vllm.is_vllm_available = lambda *a, **k: True  # the install check only
            client = trl_vllm.VLLMClient(base_url=engine_url, connection_timeout=60)
            rollout = LoomRolloutFunc(
                settings.service_url("gateway"),
                key,
                mode="plain",
                tasks=tasks,
                sampling={"ignore_eos": True},
            )

            def loom() -> tuple[float, int]:
                t0 = time.perf_counter()
                out = rollout(repeated, trainer)
                dt = time.perf_counter() - t0
                assert len(out["completion_ids"]) == len(repeated)
                return dt, sum(len(c) for c in out["completion_ids"])

            def trl() -> tuple[float, int]:
                t0 = time.perf_counter()
                out = client.generate(
                    prompt_ids,
                    n=args.group,
                    temperature=args.temperature,
                    top_p=1.0,
                    top_k=0,
                    max_tokens=args.max_tokens,
                    logprobs=0,
                    generation_kwargs={"ignore_eos": True},
                )
                dt = time.perf_counter() - t0
                assert len(out["completion_ids"]) == len(repeated)
                return dt, sum(len(c) for c in out["completion_ids"])

            sides = {"loom": loom, "trl": trl}
            for f in sides.values():  # warm-up: the engines' first batches, the stack's first job
                f()
            times: dict[str, list[float]] = {"loom": [], "trl": []}
            tokens: dict[str, list[int]] = {"loom": [], "trl": []}
            for r in range(args.reps):
                order = ("loom", "trl") if r % 2 == 0 else ("trl", "loom")
                for side in order:
                    dt, n_tok = sides[side]()
                    times[side].append(dt)
                    tokens[side].append(n_tok)
                    print(f"rep {r} {side}: {dt:.2f} s, {n_tok} tokens", flush=True)
            profile = _profile(rollout, repeated, trainer) if args.profile else None
            timelines = [_timeline(timeline_file, loom) for _ in range(args.timeline)]
            engine_spans = [_engine_span(engine_timeline, trl) for _ in range(args.timeline)]
            rollout.close()
            client.session.close()
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=15)
        except subprocess.TimeoutExpired:
            engine.kill()
        engine_log.close()
    med = {side: statistics.median(v) for side, v in times.items()}
    pairs = [a / b - 1.0 for a, b in zip(times["loom"], times["trl"], strict=True)]  # rep r's two calls
    return {
        "prompts": args.prompts,
        "num_generations": args.group,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "rollout_concurrency": args.concurrency,
        "reward_concurrency": args.reward_concurrency,
        "reps": args.reps,
        "loom_s": times["loom"],
        "trl_s": times["trl"],
        "loom_tokens": tokens["loom"],
        "trl_tokens": tokens["trl"],
        "loom_median_s": med["loom"],
        "trl_median_s": med["trl"],
        "overhead": med["loom"] / med["trl"] - 1.0,
        "pair_overheads": pairs,
        "median_pair_overhead": statistics.median(pairs),
        "profile": profile,
        "timelines": timelines,
        "trl_engine_spans": engine_spans,
        "load_avg_start": load_start,
        "load_avg": os.getloadavg(),
    }


def _profile(rollout: Any, repeated: list[str], trainer: Any) -> dict[str, Any]:
    """One Loom call in phases: submission, first and last group on the stream, the adapter's rest."""
    client = rollout.rollouts
    inner_submit, inner_groups = client.submit, client.groups
    marks: dict[str, Any] = {"groups_at": []}

    def submit(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        job = inner_submit(*a, **kw)
        marks["submit_s"] = time.perf_counter() - t
        marks["submitted"] = time.perf_counter()
        return job

    def groups(*a: Any, **kw: Any) -> Any:
        for g in inner_groups(*a, **kw):
            marks["groups_at"].append(time.perf_counter())
            yield g

    client.submit, client.groups = submit, groups
    try:
        t0 = time.perf_counter()
        rollout(repeated, trainer)
        total = time.perf_counter() - t0
    finally:
        client.submit, client.groups = inner_submit, inner_groups
    at = marks["groups_at"]
    if "submitted" not in marks or not at:
        return {"total_s": total, "note": "generate() did not go through submit/groups"}
    start = marks["submitted"]
    return {
        "total_s": total,
        "submit_s": marks["submit_s"],
        "first_group_s": at[0] - start,
        "last_group_s": at[-1] - start,
        "group_gaps_s": [b - a for a, b in zip(at, at[1:], strict=False)],
        "after_last_group_s": t0 + total - at[-1],
    }


# the stages of one group in path order: (label, event, which task key: generate or score)
_STAGES = (
    ("gen publish", "publish", "gen"),
    ("gen published", "published", "gen"),
    ("rollout worker claims", "claim", "gen"),
    ("rollout task start", "task_start", "gen"),
    ("engine call", "engine_call", "gen"),
    ("engine done", "engine_done", "gen"),
    ("rollout task end", "task_end", "gen"),
    ("gen result at gateway", "result", "gen"),
    ("score publish", "publish", "score"),
    ("reward worker claims", "claim", "score"),
    ("score start", "score_start", "score"),
    ("score end", "score_end", "score"),
    ("score result at gateway", "result", "score"),
    ("group stored", "stored", "job"),
)


def _timeline(path: Path, call: Any) -> dict[str, Any]:
    """One Loom call's marks (loom/timeline.py) as seconds after the call began: per stage the first
    and the last of its groups; the engine's admits (requests, rows already running) and batch ends;
    the event stream's sends."""
    from loom.timeline import read

    t0 = time.time()
    total, _ = call()
    t1 = time.time()
    marks = [m for m in read(path) if t0 <= m["t"] <= t1]
    publishes = [m["key"] for m in marks if m["event"] == "publish" and not m["key"].endswith(".score")]
    if not publishes:
        return {"total_s": total, "note": "no marks: LOOM_TIMELINE unset in the stack?"}
    job = publishes[0].split(".", 1)[0]

    def kind(key: str) -> str:
        if key.endswith(".score"):
            return "score"
        return "gen" if key.count(".") == 2 else "job"

    stages: dict[str, list[float]] = {}
    for label, event, which in _STAGES:
        ts = [
            m["t"] - t0
            for m in marks
            if m["event"] == event and m["key"].startswith(job + ".") and kind(m["key"]) == which
        ]
        if ts:
            stages[label] = [round(min(ts), 4), round(max(ts), 4), len(ts)]
    return {
        "total_s": total,
        "job": job,
        "stages": stages,
        "admits": [
            [round(m["t"] - t0, 4), m.get("requests"), m.get("rows")] for m in marks if m["event"] == "admit"
        ],
        "engine_span_s": _span(marks),
        "batch_ends": [round(m["t"] - t0, 4) for m in marks if m["event"] == "batch_end"],
        # reward tasks scoring several groups (``reward.score_groups``): claimed, started
        "score_batches": [
            [m["event"], round(m["t"] - t0, 4)]
            for m in marks
            if m["event"] in ("claim", "batch_start") and m["key"].startswith("scores-")
        ],
        "sent": [round(m["t"] - t0, 4) for m in marks if m["event"] == "sent" and m["key"] == job],
    }


def _engine_span(path: Path, call: Any) -> dict[str, float]:
    """One TRL call against its engine server: the call's time and the engine's own span in it (its
    first admit to its last batch end), the same span ``_timeline`` gives of a Loom call's engine, so
    the two engines' batches compare side by side (a longer one is the decode slowed, not a hop)."""
    from loom.timeline import read

    t0 = time.time()
    total, _ = call()
    t1 = time.time()
    marks = [m for m in read(path) if t0 <= m["t"] <= t1]
    span = _span(marks)
    if span is None:
        return {"total_s": total}
    first = min(m["t"] for m in marks if m["event"] == "admit")
    return {
        "total_s": total,
        "first_admit_s": round(first - t0, 4),
        "engine_span_s": span,
        "after_engine_s": round(t1 - first - span, 4),
    }


def _span(marks: list[dict[str, Any]]) -> float | None:
    """An engine's span in one call's marks: its first admit to its last batch end."""
    admits = [m["t"] for m in marks if m["event"] == "admit"]
    ends = [m["t"] for m in marks if m["event"] == "batch_end"]
    return round(max(ends) - min(admits), 4) if admits and ends else None


def _print_timeline(tl: dict[str, Any]) -> None:
    if "stages" not in tl:
        print(tl)
        return
    print(f"timeline of job {tl['job']} ({tl['total_s']:.3f} s): stage first last (groups)")
    for label, (first, last, n) in tl["stages"].items():
        print(f"  {label:26s} {first:7.3f} {last:7.3f} ({n})")
    print(f"  engine admits (s, requests, rows running): {tl['admits']}")
    print(f"  engine batch ends: {tl['batch_ends']}")
    if tl.get("score_batches"):
        print(f"  reward batches (claim / batch_start, s): {tl['score_batches']}")
    sent = tl["sent"]
    if sent:
        print(f"  stream sends: {len(sent)}, first {min(sent):.3f}, last {max(sent):.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per call")
    p.add_argument("--group", type=int, default=8, help="num_generations")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=6, help="timed calls of each side, alternating")
    p.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="LOOM_ROLLOUT_CONCURRENCY: groups the rollout worker's engine batches at once",
    )
    p.add_argument(
        "--reward-concurrency",
        type=int,
        default=0,
        help="LOOM_WORKER_CONCURRENCY of the reward worker (0: its default)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="break one Loom call down after the reps")
    p.add_argument(
        "--timeline",
        type=int,
        default=0,
        metavar="N",
        help="after the reps, N more Loom calls with the worker-side timeline printed (LOOM_TIMELINE)",
    )
    p.add_argument("--out", type=Path, help="append the result as a JSON line")
    args = p.parse_args(argv)
    r = run(args)
    print(json.dumps(r), flush=True)
    for tl in r["timelines"]:
        _print_timeline(tl)
    loom_spans = [tl["engine_span_s"] for tl in r["timelines"] if tl.get("engine_span_s") is not None]
    trl_spans = [e["engine_span_s"] for e in r["trl_engine_spans"] if "engine_span_s" in e]
    if loom_spans and trl_spans:
        loom_s = statistics.median(loom_spans)
        trl_s = statistics.median(trl_spans)
        print(
            f"engine span (first admit -> last batch end), median of {len(loom_spans)} calls each: "
            f"loom {loom_s:.3f} s, trl {trl_s:.3f} s ({loom_s / trl_s - 1:+.1%}); "
            f"trl calls {[e['total_s'] for e in r['trl_engine_spans']]}, "
            f"their first admit {[e.get('first_admit_s') for e in r['trl_engine_spans']]} s"
        )
    print(
        f"loom median {r['loom_median_s']:.2f} s, trl median {r['trl_median_s']:.2f} s: "
        f"overhead {r['overhead']:+.1%}, median of the {len(r['pair_overheads'])} pairs "
        f"{r['median_pair_overhead']:+.1%} (tokens per call: loom {set(r['loom_tokens'])}, "
        f"trl {set(r['trl_tokens'])}); load average {r['load_avg_start'][0]:.2f} at the start, "
        f"{r['load_avg'][0]:.2f} at the end"
    )
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
