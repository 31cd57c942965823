"""TRL 1.16's own ``GRPOTrainer`` with every rollout from Loom (issue 34; docs/interop-rollout.md, "TRL").

A local stack (``launch.stack.Stack``: gateway, rollout and reward, the embedded broker, the torch
engine serving the built-in tiny model) generates each step's groups through a gateway job
(``loom.clients.trl_rollout.LoomRolloutFunc``: tree or streaming mode), rewarded by the job's spec
(accuracy); TRL trains the same tiny model on CPU with its GRPO loss and, at every step that trained,
publishes its weights as policy version = step (``PolicyPublisher``: the gateway's upload routes, into
the trainer key's namespace), which the job of the next step asks for exactly.

Printed (and written with ``--out``): per step the mean reward TRL trained on, its 10-step means, the
first and last ten steps' means, the least-squares slope of the reward over the step with its
standard error, 10-step means of TRL's own metrics (clip ratios, entropy, grad norm, completion
lengths, zero-std groups), whether every trajectory carried the version of its step, the largest gap
between Loom's behaviour log-probs and the trainer's own at the temperature (every
``--check-logprobs`` steps; the stack reports processed log-probs), held-out greedy accuracy of the
format before and after, the wall time per step and how many tree leaves each group grew.
``--native`` is the control: the same trainer, prompts and settings with TRL's own generation (HF
``generate``) and the exact accuracy of the boxed answer as the reward.

    python bench/trl_rollout.py --mode tree|streaming|plain|agent [--steps 60] [--prompts 8] [--group 8]
                                [--lr 1e-4] [--warmup 20] [--scheduler constant_with_warmup]
                                [--temperature 1.3|1.0] [--weight-decay 0.01] [--loss-type dapo]
                                [--beta 0.0] [--epsilon-high 0.28] [--seed 0] [--eval 64] [--native]
                                [--check-logprobs 10] [--progress FILE.jsonl]
                                [--out FILE.json] [--plot FILE.png]
    python bench/trl_rollout.py --replot FILE.jsonl --plot FILE.png   # --out and/or --progress lines

Training prompts are the tiny model's arithmetic (+ and -, 2-3 digits: ``tiny_problems``, as ``loom
demo`` and the held-out set); the defaults are ``loom demo``'s learner settings in TRL's terms.
``--mode agent``: the built-in tool model (zoo/tiny/tool.py) on its own arithmetic, the calculator enabled,
sampled at temperature 1.0 unless ``--temperature`` says otherwise: at 1.3 most of its samples break
their calls (misspelt tool names, torn tags) and TRL's reward did not rise (docs/interop-rollout.md,
"Measured: agent mode with tools").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import secrets
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _BENCH]

TREE = {"strategy": "random", "branches": 1, "continuations": 2, "min_distance": 4}
STREAM = {"segment_cap": 32, "answer_max_tokens": 16}
# --mode agent: the built-in tool model (zoo/tiny/tool.py) on its arithmetic, the calculator enabled
AGENT_MODEL = "tool"
TEMPERATURE = {"agent": 1.0}  # a mode's default sampling temperature where not the demo's 1.3 (docstring)


def _agent_params() -> dict[str, Any]:
    from zoo.tiny import tool

    return {"parser": tool.PARSER, "tools": tool.TOOLS_ON, "max_turns": tool.MAX_TURNS}


def _model_name(mode: str) -> str:
    return AGENT_MODEL if mode == "agent" else "tiny"


def _problems(mode: str, n: int, seed: int, split: str) -> list[Any]:
    """The training or held-out problems: the tiny model's arithmetic, or the tool model's."""
    from zoo.tiny import tiny_problems, tool

    return tool.tool_problems(n, seed, split) if mode == "agent" else tiny_problems("arith", n, seed, split)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tasks(mode: str, problems: list[Any]) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The TRL dataset rows and, per prompt, its Loom task."""
    from zoo.tiny import STREAM_HEADER, plain_prompt
    from zoo.tiny.traces import stream_sentences

    if mode in ("tree", "plain", "agent"):
        rows = [{"prompt": plain_prompt(p), "answer": p.gold} for p in problems]
        return rows, {plain_prompt(p): {"label": p.gold, "task": "arithmetic"} for p in problems}
    rows = [{"prompt": p.text, "answer": p.gold} for p in problems]
    tasks = {
        p.text: {
            "prompt": STREAM_HEADER,
            "label": p.gold,
            "task": "arithmetic",
            "mode_params": {"sentences": stream_sentences(p), **STREAM},
        }
        for p in problems
    }
    return rows, tasks


def held_out(mode: str, model: Any, tok: Any, n: int) -> float:
    from zoo.tiny import HELDOUT_SEED, tool
    from zoo.tiny.evaluate import eval_plain, eval_stream

    problems = _problems(mode, n, HELDOUT_SEED, "test")
    model.eval()
    if mode == "agent":  # greedy episodes with the calculator (the tool model's card loop)
        return tool.eval_agent(model, tok, problems, tool.TOOLS_ON).accuracy
    res = eval_plain(model, tok, problems) if mode != "streaming" else eval_stream(model, tok, problems)
    return res.accuracy


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from launch.stack import Stack
    from loom.clients.policies import PolicyPublisher
    from loom.clients.trl_rollout import LoomRolloutFunc, job_reward, off_policy_calls, publish_with
    from loom.contracts.settings import Settings
    from loom.store import PolicyStore
    from zoo.registry import resolve_model_path
    from zoo.tiny import load_model as load_path
    from zoo.tiny import load_tokenizer

    torch.set_num_threads(1)
    temperature = args.temperature if args.temperature is not None else TEMPERATURE.get(args.mode, 1.3)
    tmp = Path(tempfile.mkdtemp(prefix="loom-trl-rollout-"))
    # the distribution the tiny model was trained on and is held out from (`loom demo`'s built-in set)
    problems = _problems(args.mode, args.steps * args.prompts, args.seed, "train")
    rows, tasks = _tasks(args.mode, problems)
    checkpoint = resolve_model_path(_model_name(args.mode))

    def load_model() -> Any:
        return load_path(checkpoint)

    tok = load_tokenizer(checkpoint)
    acc_before = held_out(args.mode, load_model(), tok, args.eval)
    run_info = {
        "mode": "native" if args.native else args.mode,
        "prompts_per_step": args.prompts,
        "num_generations": args.group,
        "leaves": args.leaves,
        "lr": args.lr,
        "temperature": temperature,
        "heldout_acc_before": acc_before,
    }
    config = GRPOConfig(
        output_dir=str(tmp / "trl"),
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=temperature,
        learning_rate=args.lr,
        lr_scheduler_type=args.scheduler,
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        loss_type=args.loss_type,
        beta=args.beta,
        epsilon_high=args.epsilon_high,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        dataloader_num_workers=0,
    )

    def train(reward: Any, rollout_func: Any = None) -> tuple[Any, float]:
        torch.manual_seed(args.seed)
        trainer = GRPOTrainer(
            model=load_model(),
            reward_funcs=[reward],
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
            rollout_func=rollout_func,
            callbacks=[_progress_callback(args.progress, run_info)] if args.progress else None,
        )
        t0 = time.perf_counter()
        trainer.train()
        return trainer, time.perf_counter() - t0

    out: dict[str, Any] = {}
    if args.native:  # the control: TRL generates itself (HF generate), exact accuracy as the reward
        gold = {r["prompt"]: r["answer"] for r in rows}

        def job_reward(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:  # same log key
            return [float(_boxed(c) == gold[p]) for p, c in zip(prompts, completions, strict=True)]

        trainer, wall = train(job_reward)
    else:
        ports = {
            f"{svc}_port": _free_port() for svc in ("gateway", "rollout", "reward", "reflect", "learner")
        }
        key = "loom_" + secrets.token_urlsafe(24)  # the trainer's key: it publishes into namespace "trainer"
        keys = f"trainer:{hashlib.sha256(key.encode()).hexdigest()}:jobs+policy"
        embedded = {"broker_url": "embedded", "result_backend": "embedded"}
        # processed log-probs: the tempered distribution's, as TRL recomputes them (``trl_logprobs``)
        settings = Settings(
            data_dir=tmp,
            api_keys=keys,
            engine_logprobs_mode="processed",
            model=_model_name(args.mode),
            **embedded,
            **ports,
        )
        store = PolicyStore(settings.policy_store_path / "ns" / "trainer")
        with Stack(settings, services=("gateway", "rollout", "reward"), ready_timeout=300):
            url = settings.service_url("gateway")
            rollout = LoomRolloutFunc(
                url,
                key,
                mode=args.mode,
                mode_params={"tree": TREE, "agent": _agent_params()}.get(args.mode),
                tasks=tasks,
                publish=publish_with(PolicyPublisher(url, key), tok),
                leaves=args.leaves,
            )
            leaves: list[int] = []
            step_s: list[float] = []
            inner_generate = rollout.rollouts.generate

            def counted(*a: Any, **kw: Any) -> Any:
                groups = inner_generate(*a, **kw)
                leaves.extend(len(g.samples) for g in groups)
                return groups

            logp_gap: list[float] = []

            def timed(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
                t0 = time.perf_counter()
                result = rollout(prompts, trainer)
                step_s.append(time.perf_counter() - t0)
                if args.check_logprobs and trainer.state.global_step % args.check_logprobs == 0:
                    logp_gap.append(_logprob_gap(trainer, result, temperature))
                return result

            rollout.rollouts.generate = counted  # type: ignore[method-assign]
            trainer, wall = train(job_reward, timed)
        out = {
            "versions_checked": sum(len(h["versions"]) for h in rollout.history),
            "off_policy_calls": off_policy_calls(rollout.history, staleness=0),
            "published_versions": len(store.versions()),
            "rollout_s_per_step": sum(step_s) / len(step_s),
            "leaves_per_group": sum(leaves) / len(leaves) if leaves else None,
            "logprob_gap_max": max(logp_gap) if logp_gap else None,
        }
    logged = [h for h in trainer.state.log_history if "rewards/job_reward/mean" in h]
    rewards = [h["rewards/job_reward/mean"] for h in logged]
    k = min(10, len(rewards))
    slope, slope_se = _slope(rewards)
    return {
        "mode": "native" if args.native else args.mode,
        "steps": trainer.state.global_step,
        "prompts_per_step": args.prompts,
        "num_generations": args.group,
        "leaves": args.leaves,
        "lr": args.lr,
        "warmup": args.warmup,
        "scheduler": args.scheduler,
        "temperature": temperature,
        "weight_decay": args.weight_decay,
        "loss_type": args.loss_type,
        "beta": args.beta,
        "epsilon_high": args.epsilon_high,
        "seed": args.seed,
        "reward_per_step": rewards,
        "reward_first10": sum(rewards[:k]) / k,
        "reward_last10": sum(rewards[-k:]) / k,
        "reward_10step_means": [round(sum(c) / len(c), 3) for c in _chunks(rewards, 10)],
        "reward_slope_per_step": slope,
        "reward_slope_se": slope_se,
        "trl_metrics": _metric_means(logged),
        "heldout_acc_before": acc_before,
        "heldout_acc_after": held_out(args.mode, trainer.model, tok, args.eval),
        "heldout_n": args.eval,
        "wall_s": wall,
        **out,
    }


def _progress_callback(path: Path, run_info: dict[str, Any]) -> Any:
    """A TRL callback appending each logged step (the run's settings, its reward, TRL's metrics and
    the wall clock) to ``path`` as a JSON line as it happens, so a run stopped before its end still
    leaves its steps (``--replot`` reads them back as a run without a held-out accuracy after)."""
    from transformers import TrainerCallback

    class Progress(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "rewards/job_reward/mean" in logs:
                line = {**run_info, "step": state.global_step, "time": time.time(), **logs}
                with open(path, "a") as f:
                    f.write(json.dumps(line) + "\n")

    return Progress()


def _logprob_gap(trainer: Any, result: dict[str, list[Any]], temperature: float) -> float:
    """The largest |Loom's behaviour log-prob - the trainer's own| over the trained tokens of a call,
    the trainer's computed as TRL computes them (logits / temperature, then log-softmax)."""
    import torch

    model = trainer.accelerator.unwrap_model(trainer.model)
    gap = 0.0
    with torch.no_grad():
        rows = (result[k] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask"))
        for p, c, lp, m in zip(*rows, strict=True):
            logits = model(torch.tensor([list(p) + list(c)])).logits[0, len(p) - 1 : -1].float()
            ref = torch.log_softmax(logits / temperature, dim=-1)
            mine = ref.gather(1, torch.tensor(list(c)).unsqueeze(1)).squeeze(1)
            if any(x is None for x in lp):  # not the tempered distribution's (``trl_logprobs``)
                return float("nan")
            keep = torch.tensor(list(m), dtype=torch.bool)
            if keep.any():
                gap = max(gap, float((mine - torch.tensor(lp))[keep].abs().max()))
    return gap


def _chunks(xs: list[float], n: int) -> list[list[float]]:
    return [xs[i : i + n] for i in range(0, len(xs), n)]


def _slope(ys: list[float]) -> tuple[float | None, float | None]:
    """Least-squares slope of ``ys`` over their index (the step), and its standard error."""
    n = len(ys)
    if n < 3:
        return None, None
    mx, my = (n - 1) / 2, sum(ys) / n
    sxx = sum((i - mx) ** 2 for i in range(n))
    b = sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sxx
    resid = sum((y - my - b * (i - mx)) ** 2 for i, y in enumerate(ys))
    return b, (resid / (n - 2) / sxx) ** 0.5


# TRL's logged per-step metrics worth reading beside the reward: clipping, entropy, lengths, grad norm
_METRICS = (
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "entropy",
    "grad_norm",
    "completions/mean_length",
    "completions/clipped_ratio",
    "frac_reward_zero_std",
    "reward_std",
)


def _metric_means(logged: list[dict[str, Any]]) -> dict[str, list[float]]:
    """10-step means of TRL's metrics in ``_METRICS`` (those it logged)."""
    out = {}
    for key in _METRICS:
        vals = [float(h[key]) for h in logged if key in h]
        if vals:
            out[key] = [round(sum(c) / len(c), 4) for c in _chunks(vals, 10)]
    return out


def _boxed(completion: str) -> str | None:
    from loom.answers import last_boxed

    return last_boxed(completion) if "</think>" in completion else None


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ys = r["reward_per_step"]
        w = 5
        smooth = [
            sum(ys[max(0, i - w + 1) : i + 1]) / len(ys[max(0, i - w + 1) : i + 1]) for i in range(len(ys))
        ]
        ax.plot(range(len(ys)), ys, alpha=0.3)
        before, after = r.get("heldout_acc_before"), r.get("heldout_acc_after")
        # a run stopped before its end (its steps read back from --progress) has no held-out after
        held = f"held-out {before:.2f} -> {after:.2f}" if after is not None else f"stopped at step {len(ys)}"
        temp = r.get("temperature", 1.0)
        seed = r.get("seed", 0)
        run = f"{r['prompts_per_step']}x{r['num_generations']}, lr {r['lr']:g}, T {temp:g}, seed {seed}"
        mode = f"{r['mode']}, {r['leaves']} leaves" if r["mode"] == "tree" and r.get("leaves") else r["mode"]
        label = f"{mode} {run} (5-step mean; {held})"
        ax.plot(range(len(ys)), smooth, label=label, color=ax.lines[-1].get_color(), linewidth=2)
    ax.set_title("TRL GRPOTrainer on Loom rollouts (prompts x samples a step)", fontsize=10)
    ax.set_xlabel("TRL step")
    ax.set_ylabel("mean reward (accuracy)")
    ax.set_ylim(0.0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _read_runs(path: Path) -> list[dict[str, Any]]:
    """The runs of a file of ``--out`` lines and/or ``--progress`` lines (one run per mode, in order)."""
    runs: list[dict[str, Any]] = []
    partial: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "reward_per_step" in r:
            runs.append(r)
            continue
        run = partial.setdefault(r["mode"], {**r, "reward_per_step": [], "heldout_acc_after": None})
        run["reward_per_step"].append(r["rewards/job_reward/mean"])
    return runs + list(partial.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", dest="modes", choices=["tree", "streaming", "plain", "agent"], action="append")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument(
        "--leaves",
        choices=["subtree", "spread"],
        default="subtree",
        help="which n of a tree's leaves TRL trains (loom/clients/trainer_rows.py pick_leaves; the "
        "adapters' default: over two seeds neither rule rose more, docs/interop-rollout.md)",
    )
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per step")
    p.add_argument("--group", type=int, default=8, help="num_generations")
    p.add_argument("--max-tokens", type=int, default=96)
    # the defaults are `loom demo`'s learner settings in TRL's terms (docs/interop-rollout.md, "TRL")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=float, default=20, help="linear warmup: steps, or a fraction < 1 of them")
    p.add_argument(
        "--scheduler", default="constant_with_warmup", help="lr_scheduler_type (TRL's default: linear decay)"
    )
    p.add_argument(
        "--temperature", type=float, help="sampling and log-prob temperature (default 1.3; agent mode 1.0)"
    )
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--loss-type", default="dapo", help="TRL's loss_type (dapo: token mean, Loom's)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient")
    p.add_argument("--epsilon-high", type=float, default=0.28, help="clip-higher (Loom's eps_high)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval", type=int, default=64, help="held-out problems, greedy")
    p.add_argument(
        "--check-logprobs",
        type=int,
        default=10,
        metavar="N",
        help="every N steps, compare Loom's behaviour log-probs with the trainer's (0: never)",
    )
    p.add_argument("--native", action="store_true", help="control: TRL's own generation (tree's prompts)")
    p.add_argument("--out", type=Path, help="append the results as JSON lines")
    p.add_argument("--progress", type=Path, help="append each step's TRL log as a JSON line as it happens")
    p.add_argument("--plot", type=Path, help="the reward curves as a PNG")
    p.add_argument("--replot", type=Path, help="only plot the JSON lines of earlier --out runs to --plot")
    args = p.parse_args(argv)
    if args.replot:
        plot(_read_runs(args.replot), args.plot)
        return 0
    results = []
    for mode in (args.modes or ["tree"]) if not args.native else ["tree"]:
        args.mode = mode
        r = run(args)
        results.append(r)
        shown = {k: v for k, v in r.items() if k != "reward_per_step"}
        print(json.dumps(shown), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
