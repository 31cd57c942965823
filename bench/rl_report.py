"""The paper benches' options and reporting (bench/adasr.py, bench/rea.py): the options every RL bench
takes, tables, the plot of the per-step curves, one seed's run as JSON and several seeds' runs as one
table (mean ± standard error). The loop itself is bench/rl_loop.py over the product's RL step
(gateway/step.py)."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.rl_loop import Arm, LoopConfig


@dataclass
class Eval:
    accuracy: float  # greedy
    means: dict[str, float]
    sampled: float | None = None  # responses sampled at the training temperature (LoopConfig.eval_samples)


@dataclass
class StepLog:
    step: int
    reward: float  # of the sampled originals (revisions left out), as accuracy and means
    accuracy: float
    means: dict[str, float]
    skipped: bool
    seconds: float
    revisions: int = 0
    trained_groups: int = 0


@dataclass
class ArmResult:
    arm: Arm
    steps: list[StepLog]
    after: Eval
    weight_change: float  # ||w - w_start|| / ||w_start|| over every parameter
    policy_version: int  # the version the engine serves at the end (0: still the start checkpoint)
    seconds: float


def weight_change(start: dict[str, Any], now: dict[str, Any]) -> float:
    """||w - w_start|| / ||w_start|| over every parameter tensor (0 for an untrained policy)."""
    diff = base = 0.0
    for k, w0 in start.items():
        w = now[k].detach().to(w0.device)
        diff += float(((w - w0).float() ** 2).sum())
        base += float((w0.float() ** 2).sum())
    return math.sqrt(diff) / math.sqrt(base) if base > 0 else 0.0


def step_line(arm: Arm, entry: StepLog, cfg: LoopConfig) -> str:
    shown = " ".join(f"{k} {v:.1f}" for k, v in entry.means.items())
    return (
        f"  [{arm.name}] step {entry.step}: reward {entry.reward:+.3f} acc {entry.accuracy:.2f} {shown}"
        + (f" revisions {entry.revisions}" if arm.reflect is not None else "")
        + (f" groups trained {entry.trained_groups}/{cfg.prompts}" if cfg.filter_groups is not None else "")
        + (" (no update)" if entry.skipped else "")
        + f" ({entry.seconds:.1f} s)"
    )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    for r in rows:
        out.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        )
    return "\n".join(out)


def write_out(
    path: Path, title: str, table: str, results: Sequence[ArmResult], curves: Sequence[tuple[str, str]]
) -> list[str]:
    """The markdown table to ``path`` (bench/report.py: date, machine, command) and a PNG of the
    per-step curves beside it (``curves``: (label, key of StepLog.means, or 'reward' / 'accuracy')).
    The lines to print."""
    from bench.report import write

    def plot(fig) -> None:  # type: ignore[no-untyped-def]
        for ax, (label, key) in zip(fig.subplots(1, len(curves), squeeze=False)[0], curves, strict=True):
            for r in results:
                xs = [s.step for s in r.steps]
                ys = [
                    getattr(s, key) if key in ("reward", "accuracy") else s.means.get(key, 0.0)
                    for s in r.steps
                ]
                ax.plot(xs, ys, marker=".", label=r.arm.name)
            ax.set_xlabel("step")
            ax.set_title(label, fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)

    md = write(
        path.stem, title, table.splitlines(), plot=plot, out_dir=path.parent, figsize=(4.2 * len(curves), 3.4)
    )
    return [f"table: {md}", f"plot:  {md.with_suffix('.png')}"]


def add_seed_args(p: Any) -> None:
    """``--json`` (one seed's run, for ``--summarize``) and ``--summarize`` (several seeds' files as one
    table, mean ± standard error, to ``--out``; no run)."""
    p.add_argument("--json", type=Path, default=None, help="write this seed's run as JSON (for --summarize)")
    p.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        default=None,
        help="no run: the --json files of several seeds as one table (mean ± standard error), to --out",
    )


def write_record(path: Path | None, cfg: LoopConfig, base: Eval, results: Sequence[ArmResult]) -> None:
    if path is not None:
        path.write_text(json.dumps(run_record(cfg, base, results), indent=1) + "\n")


def write_summary(paths: Sequence[Path], out: Path | None, name: str, against: str, arm: str) -> None:
    """Several seeds' runs (``--json`` files) as one table, printed and written to ``out``."""
    records = [json.loads(p.read_text()) for p in paths]
    header, rows = summarize(records, against=against, arm=arm)
    r0 = records[0]
    title = (
        f"{name}, {model_name(r0['model'])} model, {r0['steps']} steps, lr {r0['lr']}, {len(records)} seeds"
    )
    print(title)
    print(text_table(header, rows))
    if out is not None:
        from bench.report import write

        seeds = ", ".join(str(r["seed"]) for r in records)
        table = markdown_table(header, rows).splitlines()
        note = f"Seeds {seeds}; mean ± standard error over the seeds; one `--json` run per seed."
        settings = {a: v["loss"] for a, v in r0["arms"].items() if v.get("loss")}
        if settings:
            note += " Loss settings per arm: " + "; ".join(f"{a} {s}" for a, s in settings.items()) + "."
        weights = {a: v["rewards"] for a, v in r0["arms"].items() if "rewards" in v}
        if len({json.dumps(w, sort_keys=True) for w in weights.values()}) > 1:
            note += " Reward weights per arm: " + "; ".join(f"{a} {w}" for a, w in weights.items()) + "."
        if r0.get("filter_groups"):
            trained = {
                a: mean_se([r["arms"][a]["trained_groups"] / (r["steps"] * r["prompts"]) for r in records])
                for a in r0["arms"]
            }
            note += (
                f" Groups whose {r0['filter_groups']} is the same for every response were left out of each"
                " update (DAPO's dynamic sampling without re-sampling); fraction of groups trained per arm: "
                + "; ".join(f"{a} {v}" for a, v in trained.items())
                + "."
            )
        print(write(out.stem, title, [note, "", *table], out_dir=out.parent))


def model_name(path: str) -> str:
    """A built-in model's name (zoo.registry.BUILTIN) for its checkpoint path, else the path."""
    from zoo.registry import BUILTIN, resolve_model_path

    for name in BUILTIN:
        if resolve_model_path(name).resolve() == Path(path).resolve():
            return name
    return path


def run_record(cfg: LoopConfig, base: Eval, results: Sequence[ArmResult]) -> dict[str, Any]:
    """One seed's run as JSON (``--json``): the start and every arm's held-out measures, their train
    measures on the first and the last 4 steps, and the seconds. ``summarize`` reads several."""

    def train_means(steps: Sequence[StepLog]) -> dict[str, float]:
        keys = ["accuracy", *steps[0].means] if steps else []
        return {
            k: statistics.fmean(s.accuracy if k == "accuracy" else s.means[k] for s in steps) for k in keys
        }

    return {
        "seed": cfg.seed,
        "model": model_name(str(cfg.model)),
        "steps": cfg.steps,
        "prompts": cfg.prompts,
        "lr": cfg.lr,
        "filter_groups": cfg.filter_groups,
        "start": {"accuracy": base.accuracy, **base.means},
        "arms": {
            r.arm.name: {
                "loss": r.arm.loss,
                "rewards": {c.name: c.weight for c in r.arm.spec.components},
                "held_out": {"accuracy": r.after.accuracy, **r.after.means},
                "train_first": train_means(r.steps[:4]),
                "train_last": train_means(r.steps[-4:]),
                "weight_change": r.weight_change,
                "trained_groups": sum(s.trained_groups for s in r.steps),
                "seconds": r.seconds,
            }
            for r in results
        },
    }


def mean_se(xs: Sequence[float]) -> str:
    """``mean ± standard error`` (the sample standard deviation over sqrt(n); ± - for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return f"{m:.3f} ± -"
    return f"{m:.3f} ± {statistics.stdev(xs) / math.sqrt(len(xs)):.3f}"


def summarize(records: Sequence[dict[str, Any]], against: str, arm: str) -> tuple[list[str], list[list[str]]]:
    """Several seeds' ``run_record``s as one table: per measure, the start, each arm and the paired
    difference ``arm - against`` (per seed, then mean ± standard error over the seeds)."""
    keys = list(records[0]["start"])
    arms = list(records[0]["arms"])
    header = ["measure", "start", *arms, f"{arm} - {against} (paired)", "per seed"]
    rows = []
    for where, label in (
        ("held_out", "held-out"),
        ("train_first", "train, first 4 steps"),
        ("train_last", "train, last 4 steps"),
    ):
        for k in keys:
            if k not in records[0]["arms"][arm][where]:
                continue
            diffs = [r["arms"][arm][where][k] - r["arms"][against][where][k] for r in records]
            rows.append(
                [
                    f"{label} {k}",
                    mean_se([r["start"][k] for r in records]) if where == "held_out" else "",
                    *(mean_se([r["arms"][a][where][k] for r in records]) for a in arms),
                    mean_se(diffs),
                    " ".join(f"{d:+.3f}" for d in diffs),
                ]
            )
    return header, rows


def add_loop_args(
    p: Any,
    *,
    steps: int,
    prompts: int,
    group: int,
    lr: float,
    temperature: float,
    max_tokens: int,
    eval_n: int,
    warmup: int = 0,
    eval_samples: int = 0,
) -> None:
    """The options every RL bench takes (argparse parser ``p``), with the bench's defaults."""
    p.add_argument("--model", default="search", help="tiny | search | a checkpoint directory")
    p.add_argument("--steps", type=int, default=steps, help="RL steps per arm")
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    p.add_argument("--group", type=int, default=group, help="responses per prompt")
    p.add_argument("--seed", type=int, default=0, help="prompts and sampling seeds (shared by the arms)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup, help="linear lr warmup steps")
    p.add_argument("--temperature", type=float, default=temperature, help="sampling (and loss) temperature")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="response budget")
    p.add_argument("--eval", type=int, default=eval_n, help="held-out problems (greedy), before and after")
    p.add_argument(
        "--eval-samples",
        type=int,
        default=eval_samples,
        help="also sample each held-out problem this many times at --temperature (fixed seeds)",
    )
    p.add_argument(
        "--task",
        choices=("countdown", "arith"),
        default="countdown",
        help="the model's Countdown problems, or the tiny model's arithmetic",
    )
    p.add_argument(
        "--filter-groups",
        default=None,
        metavar="COMPONENT",
        help="leave out of each update the groups whose reward COMPONENT (e.g. accuracy) is the same for"
        " every response (DAPO's dynamic sampling, verl's algorithm.filter_groups, without re-sampling)",
    )
    p.add_argument("--out", type=Path, default=None, help="write a markdown table here (and a PNG beside it)")


def loop_config(args: Any) -> LoopConfig:
    from bench.rl_loop import LoopConfig
    from zoo.registry import resolve_model_path

    path = resolve_model_path(args.model)
    if not (path / "config.json").exists():
        raise SystemExit(f"no model at {path} (the search model appears after `loom train-search`)")
    return LoopConfig(
        model=path,
        steps=args.steps,
        prompts=args.prompts,
        group=args.group,
        seed=args.seed,
        lr=args.lr,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        eval_prompts=args.eval,
        warmup=args.warmup,
        filter_groups=getattr(args, "filter_groups", None),
        eval_samples=args.eval_samples,
    )


def quiet() -> None:
    """Call before configure_process: no INFO logs and no progress bars from every model load / save."""
    import os

    os.environ.setdefault("LOOM_LOG_LEVEL", "WARNING")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
