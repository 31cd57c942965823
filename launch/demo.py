"""``loom demo``: a short RL run on the built-in tiny model, driven through the platform itself.
``--task code``: the built-in code model on the built-in programming problems, rewarded by their
tests run in the stack's sandbox service (docs/sandbox.md). ``--mode agent``: multi-turn tool use, the
built-in tool model calling the calculator on its arithmetic (zoo/tiny/tool.py, docs/models.md).

It brings up the embedded stack (or uses a running gateway with ``--url``), starts a run through the
gateway's runs API (the gateway drives rollout -> reward -> learner over the queues), follows it with
a progress bar, writes ``metrics.jsonl`` and ``reward_curve.png``, prints the first and last 5-step
averages, and stops the stack it started. No in-process shortcut around the services.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from loom.contracts.modes import MODE_PARAMS

MODES = tuple(MODE_PARAMS)  # every mode of the table, posed by the built-in models (its BUILTIN_* lines)
ESTIMATORS = ("grpo", "dr_grpo", "global_baseline", "hrpo", "treerl", "apr")


def mode_rewards(mode: str) -> list[dict[str, Any]]:
    """A mode's reward spec: accuracy, and the components that check its format (its
    ``FORMAT_REWARDS``, what the tiny model's format makes checkable), logged at weight 0."""
    checks = MODE_PARAMS[mode].FORMAT_REWARDS
    return [{"name": "accuracy", "weight": 1.0}, *({"name": name, "weight": 0.0} for name in checks)]


TASKS = ("arith", "countdown", "code")
# --task code: the code model (zoo/code) and the fraction of tests passed (half code_pass, half code_all
# stayed flat, docs/benchmarks/demo.md); a code task's accuracy is code_all (reward_svc/code.py),
# logged beside it
CODE_MODEL = "code"
CODE_REWARD: list[dict[str, Any]] = [
    {"name": "code_pass", "weight": 1.0},
    {"name": "accuracy", "weight": 0.0},
]
# --task code's own defaults where a flag is not given: every sample's tests are sandbox runs (4 per
# problem, zoo/code/tasks.py), so fewer prompts per step than arithmetic's 16 (docs/benchmarks/demo.md)
# 5 warm-up steps: the budget holds only tens of its steps; temperature 1.3 (at 1.0 the sampled
# reward is three times higher but fell or stayed flat in every run, docs/benchmarks/demo.md)
CODE_DEFAULTS = {"batch_size": 8, "group_size": 8, "lr": 2e-4, "temperature": 1.3, "warmup": 5}
TASK_DEFAULTS = {"batch_size": 16, "group_size": 8, "lr": 1e-4, "temperature": 1.3, "warmup": 20}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="loom demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=MODES, default="plain")
    p.add_argument("--estimator", choices=ESTIMATORS, default="grpo")
    p.add_argument("--task", choices=TASKS, default="arith", help="code: the code model on code tasks")
    # 400 steps or --time-limit, whichever comes first: at lr 1e-4 the reward still rose at step 400
    # (10-step means 0.38 -> 0.70, +0.347 in 488 s on a quiet hour of the 2-core VM; 180 steps gave
    # +0.12 to +0.24, docs/benchmarks/demo.md), so the demo trains as long as its time allows
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=None, help="prompts per step (16; code: 8)")
    p.add_argument("--group-size", type=int, default=None, help="samples per prompt (8)")
    # 1e-4: measured 150 steps each, 2e-4 dipped for ~60 steps before rising (10-step means 0.39 ->
    # 0.35 -> 0.50), 3e-4 and 2e-4 with two updates per batch fell to ~0.28; 1e-4 rose from the start
    p.add_argument("--lr", type=float, default=None, help="1e-4 (code: 2e-4)")
    p.add_argument("--warmup", type=int, default=None, help="linear lr warmup steps (20; code: 5)")
    p.add_argument("--updates", type=int, default=1, help="optimizer steps per batch (PPO's mu)")
    # 1.3: the tiny model is so peaked that at 1.0 its sampled accuracy already equals its greedy one
    # (0.66 vs 0.75 measured on arithmetic); at 1.3 sampling leaves the policy room to improve.
    p.add_argument(
        "--tis",
        choices=("off", "token", "sequence"),
        default="off",
        help="truncated importance sampling for the rollout-train mismatch (docs/algorithms.md §5.2)",
    )
    p.add_argument("--tis-cap", type=float, default=2.0, help="C, the TIS truncation cap")
    p.add_argument(
        "--filter-groups",
        metavar="COMPONENT",
        default=None,
        help="train only the groups whose reward COMPONENT (e.g. accuracy) differs across the responses "
        "(DAPO's dynamic sampling; the run's filter_groups, docs/algorithms.md §5.3)",
    )
    p.add_argument("--temperature", type=float, default=None, help="1.3")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--staleness", type=int, default=1, help="0 = synchronous; 1 = one-step off-policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-limit",
        type=float,
        default=540.0,
        help="training time budget in seconds: the run is stopped there and the demo reports the steps it "
        "completed (with the stack's start and stop, the default fits 10 minutes)",
    )
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/demo-<time>)")
    p.add_argument("--url", default=None, help="use a running gateway instead of starting a stack")
    p.add_argument(
        "--engine",
        choices=("torch", "vllm"),
        default="torch",
        help="the rollout engine of the stack it starts: Loom's torch engine, or a real vLLM server it "
        "starts beside it (deploy/vllm-setup.sh; docs/vllm.md)",
    )
    p.add_argument("--api-key", default=os.environ.get("LOOM_API_KEY"), help="key for --url")
    p.add_argument(
        "--tracker",
        action="append",
        choices=("tensorboard", "wandb", "mlflow"),
        default=[],
        help="also log the run to this experiment tracker (repeatable; docs/trackers.md): its files go "
        "under the demo's folder, in state/runs/<run id>/trackers/<name>",
    )
    args = p.parse_args(list(argv))
    if args.task == "code" and args.mode != "plain":
        p.error("--task code runs in the plain mode")
    own = mode_model(args.mode)
    if own != "tiny" and args.task != "arith":
        p.error(f"--mode {args.mode} runs the {own} model on arithmetic (--task arith)")
    defaults = CODE_DEFAULTS if args.task == "code" else TASK_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def run_request(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "run_key": f"demo-{os.getpid()}-{int(time.time())}",
        "dataset": {"builtin": args.task, "size": 4096, "seed": args.seed},
        "mode": args.mode,
        "sampling": {
            "n": args.group_size,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
        },
        "reward": {"components": CODE_REWARD if args.task == "code" else mode_rewards(args.mode)},
        "estimator": args.estimator,
        "loss": {
            "lr": args.lr,
            "warmup_steps": args.warmup,
            "updates_per_batch": args.updates,
            "temperature": args.temperature,  # train the policy that was sampled
            "tis": args.tis,
            "tis_cap": args.tis_cap,
        },
        "schedule": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "staleness": args.staleness,
            "seed": args.seed,
        },
    }
    fields = model_fields(mode_model(args.mode))
    if fields:
        body["mode_params"] = fields["mode_params"]
        body["dataset"]["knobs"] = fields["knobs"]
    if args.filter_groups:
        body["filter_groups"] = args.filter_groups
    if args.tracker:
        body["trackers"] = [{"name": name} for name in dict.fromkeys(args.tracker)]
    return body


def mode_model(mode: str) -> str:
    """The built-in model trained for ``mode`` (its ``BUILTIN_MODEL``; ``tiny``: the demo's own)."""
    return MODE_PARAMS[mode].BUILTIN_MODEL


def model_fields(model: str) -> dict[str, Any]:
    """What a run on the built-in model ``model`` sets beyond the tiny model's: the tool model's mode
    params and dataset knobs (zoo/tiny/tool.py: its arithmetic with multi-digit multiplication, the
    calculator enabled, the function parser); none for the tiny model."""
    if model != "tool":
        return {}
    from zoo.tiny import tool

    return {
        "mode_params": {"parser": tool.PARSER, "tools": tool.TOOLS_ON, "max_turns": tool.MAX_TURNS},
        "knobs": {k: list(v) for k, v in tool.TOOL_KNOBS.items()},
    }


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r.get("reward_mean", 0.0) for r in rows], label="mean reward", marker=".")
    ax.plot(steps, [r.get("accuracy", 0.0) for r in rows], label="accuracy", marker=".", alpha=0.7)
    if len(rows) >= 5:
        rewards = [r.get("reward_mean", 0.0) for r in rows]
        smooth = [fmean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rows))]
        ax.plot(steps, smooth, label="reward (5-step mean)", linewidth=2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def follow(client: Any, run_id: str, args: argparse.Namespace, out: Path) -> tuple[str, list[dict[str, Any]]]:
    from tqdm import tqdm

    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.time_limit
    status = "running"
    sink = open(out / "metrics.jsonl", "w")  # noqa: SIM115 - closed below
    with sink, tqdm(total=args.steps, unit="step", file=sys.stdout) as bar:
        while True:
            for row in client.run_metrics(run_id, after=rows[-1]["step"] if rows else -1):
                rows.append(row)
                sink.write(json.dumps(row) + "\n")
                sink.flush()
                bar.update(1)
                bar.set_postfix(
                    reward=f"{row.get('reward_mean', 0):.3f}",
                    acc=f"{row.get('accuracy', 0):.2f}",
                    len=f"{row.get('length_mean', 0):.0f}",
                    v=int(row.get("policy_version", 0)),
                )
            view = client.run(run_id)
            status = view["status"]
            if status in ("succeeded", "failed", "cancelled") and len(rows) >= view["completed_steps"]:
                if view.get("error"):
                    bar.write(f"run {status}: {view['error']}")
                break
            if time.monotonic() > deadline:
                bar.write(
                    f"time budget of {args.time_limit:.0f} s spent after {len(rows)} steps; stopping the run"
                )
                client.cancel_run(run_id)
                status = "time_budget"
                break
            time.sleep(1.0)
    return status, rows


def reference_seconds(reps: int = 5) -> float:
    """A fixed CPU-bound loop on one core, the median of ``reps`` timings: 200 float32 matmuls of
    192 x 192 on one torch thread and 300,000 Python additions. The demo's seconds a step divided by
    it read the same on a fast host and a slow one (docs/benchmarks/demo.md, "Step time")."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference is one core's speed, whatever the process had
    try:
        a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            x = a
            for _ in range(200):
                x = (x @ a).tanh_()
            total = 0
            for i in range(300_000):
                total += i
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    return sorted(times)[len(times) // 2]


def step_times(rows: list[dict[str, Any]], reference: float) -> str:
    """Seconds a step (between the steps' records, the first step's left out: it waits for the
    stack's first generation) and its parts as the run records them, with the step time in
    reference-loop units (``reference_seconds``)."""
    if len(rows) < 3:
        return "step time: too few steps to time"
    gaps = [b["time"] - a["time"] for a, b in zip(rows[1:], rows[2:], strict=False)]
    step = fmean(gaps)

    def mean(key: str) -> float:
        return fmean(r.get(key, 0.0) for r in rows[2:])

    gen, train, wait = (mean(k) for k in ("gen_seconds", "train_seconds", "wait_gen_seconds"))
    return (
        f"step time {step:.2f} s (generation {gen:.2f} s, training {train:.2f} s, training waited for "
        f"generation {wait:.2f} s); reference loop {reference:.3f} s: {step / reference:.1f} reference "
        f"units a step; load average {os.getloadavg()[0]:.2f}"
    )


def summarise(rows: list[dict[str, Any]], seconds: float) -> str:
    if not rows:
        return "no step completed"
    k = min(5, len(rows))
    first, last = rows[:k], rows[-k:]

    def avg(sel: list[dict[str, Any]], key: str) -> float:
        return fmean(r.get(key, 0.0) for r in sel)

    lines = [
        f"steps completed: {len(rows)} in {seconds:.0f} s",
        f"first {k} steps: reward {avg(first, 'reward_mean'):.3f}  accuracy {avg(first, 'accuracy'):.3f}"
        f"  length {avg(first, 'length_mean'):.1f}",
        f"last  {k} steps: reward {avg(last, 'reward_mean'):.3f}  accuracy {avg(last, 'accuracy'):.3f}"
        f"  length {avg(last, 'length_mean'):.1f}",
        f"change: reward {avg(last, 'reward_mean') - avg(first, 'reward_mean'):+.3f}"
        f"  accuracy {avg(last, 'accuracy') - avg(first, 'accuracy'):+.3f}",
    ]
    if any("mismatch_kl_k3" in r for r in rows):  # the learner's metrics (docs/algorithms.md §5.2)
        lines.append(
            f"rollout-train mismatch (all steps): KL k3 {avg(rows, 'mismatch_kl_k3'):.2e}"
            f"  ratio p05/p95 {avg(rows, 'mismatch_ratio_p05'):.3f}/{avg(rows, 'mismatch_ratio_p95'):.3f}"
        )
    if any("tis_weight_mean" in r for r in rows):
        lines.append(
            f"TIS: weight mean {avg(rows, 'tis_weight_mean'):.3f}"
            f"  truncated {avg(rows, 'tis_truncated_frac'):.3%} of tokens"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    from loom.clients.gateway import GatewayClient

    t0 = time.monotonic()
    if args.url:
        client = GatewayClient(args.url, api_key=args.api_key)
        return _drive(client, args, out, t0)

    from launch.stack import Stack
    from loom.contracts.settings import Settings

    # A fresh data dir per demo: its own embedded broker, run state and policy store. The stack runs
    # every service, the sandbox among them, which the code reward runs the programs in.
    own = CODE_MODEL if args.task == "code" else mode_model(args.mode)
    model = {"model": own} if own != "tiny" and "LOOM_MODEL" not in os.environ else {}
    settings = Settings(data_dir=out / "state", **model)  # type: ignore[arg-type]
    if args.task == "code":
        from sandbox_svc.runner import bwrap_path

        if bwrap_path() is None:
            raise SystemExit(
                "--task code runs programs in bubblewrap: run `bash deploy/setup.sh` (docs/sandbox.md)"
            )
    print(f"starting the embedded stack (logs in {settings.data_dir / 'logs'}) ...", flush=True)
    # behaviour log-probs of the tempered policy the learner trains (vLLM: --logprobs-mode processed_logprobs,
    # and the vllm client reads it from the server)
    # a whole step's groups in flight on the rollout worker: the torch engine decodes them as one
    # batch (16 x 8 rows: ~95 forwards a step where two groups at a time took ~750, and a third
    # of the engine's CPU time; docs/benchmarks/demo.md, "Step time")
    env = {
        "LOOM_DATA_DIR": str(settings.data_dir),
        "LOOM_ENGINE_LOGPROBS_MODE": "processed",
        "LOOM_ROLLOUT_CONCURRENCY": os.environ.get("LOOM_ROLLOUT_CONCURRENCY", str(args.batch_size)),
    }
    extra, ready_timeout = [], 120.0
    if args.engine == "vllm":
        spec, url = vllm_spec(settings)
        extra, ready_timeout = [spec], 900.0  # vLLM starts in 30-150 s on 2 cores
        # the rollout worker's groups only wait on HTTP: more in flight lets vLLM batch them
        env.update(
            LOOM_ENGINE="vllm",
            LOOM_ENGINE_URL=url,
            LOOM_ROLLOUT_CONCURRENCY=os.environ.get("LOOM_ROLLOUT_CONCURRENCY", "8"),
        )
    with Stack(settings, env=env, extra=extra, ready_timeout=ready_timeout) as stack:
        print(stack.describe(), flush=True)
        client = GatewayClient(stack.urls()["gateway"], api_key=stack.api_key, timeout=120.0)
        return _drive(client, args, out, t0)


def vllm_spec(settings: Any) -> tuple[Any, str]:
    """The vLLM server of ``loom demo --engine vllm`` (rollout_svc.engines.vllm_launch): the demo's
    model with processed log-probs (the learner trains the tempered policy), dev mode for the
    full-checkpoint updates every learner step publishes, eager start-up."""
    import socket

    from launch.stack import ProcSpec
    from rollout_svc.config import VllmSettings
    from rollout_svc.engines.torch import resolve_model_path
    from rollout_svc.engines.vllm_launch import vllm_command, vllm_env, vllm_python

    python = vllm_python(VllmSettings().python)
    if not python.exists():
        raise SystemExit(f"no vLLM environment at {python}: run `bash deploy/vllm-setup.sh` (docs/vllm.md)")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    model = resolve_model_path(settings.model)
    cmd = vllm_command(python, model, port, served_name=settings.model, logprobs_mode="processed")
    # vLLM's CPU backend sizes its own threads: the stack's one-thread default is for Loom's processes
    env = {**vllm_env(base={}), "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    url = f"http://127.0.0.1:{port}"
    return ProcSpec("vllm", cmd, ready_url=f"{url}/health", env=env), url


def _drive(client: Any, args: argparse.Namespace, out: Path, t0: float) -> int:
    body = run_request(args)
    (out / "run_request.json").write_text(json.dumps(body, indent=2))
    reference = reference_seconds()  # before the run, which takes the host's cores
    run_id = client.start_run(body)
    print(f"run {run_id}: mode={args.mode} estimator={args.estimator} task={args.task} steps={args.steps}")
    login = "your API key" if args.url else "this stack's key " + client.http.headers["authorization"][7:]
    print(f"run page: {client.http.base_url}/ui/runs/{run_id} (log in with {login})", flush=True)
    t_run = time.monotonic()
    status, rows = follow(client, run_id, args, out)
    seconds = time.monotonic() - t_run
    reference = (reference + reference_seconds()) / 2  # the host's speed before and after the run
    if rows:
        plot(rows, out / "reward_curve.png", f"loom demo: {args.mode} / {args.estimator} on {args.task}")
    print(summarise(rows, seconds))
    print(step_times(rows, reference))
    print(f"metrics: {out / 'metrics.jsonl'}\ncurve:   {out / 'reward_curve.png'}")
    if args.tracker:
        where = out / "state" / "runs" / run_id / "trackers" if not args.url else "the gateway's data_dir"
        print(f"trackers ({', '.join(args.tracker)}): {where}")
    print(f"total wall time {time.monotonic() - t0:.0f} s; run {status}")
    return 0 if finished(status, rows) else 1


def finished(status: str, rows: list[dict[str, Any]]) -> bool:
    """Succeeded, or stopped at the time budget after it trained (a run that completed no step in the
    budget is a failure, whatever stopped it)."""
    return status == "succeeded" or (status == "time_budget" and len(rows) > 0)
