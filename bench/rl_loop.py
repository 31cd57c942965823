"""The in-process RL loop the paper benches share (bench/adasr.py, bench/rea.py): sample groups with the
torch engine through the rollout core (``rollout_svc.rollout.generate_group``, so each mode's real code
path), score them with the reward core (``reward_svc.core.score_group``), optionally add REA-RL revisions
(``reflect_svc.revise.revise_group``), train one ``learner.train.Learner`` step, load the published
version into the engine, repeat.

Every arm starts from the same checkpoint, sees the same prompts in the same order and samples with the
same seeds (per step and prompt); only its reward spec, estimator and revisions differ. Held-out
accuracy is greedy decoding of test-split problems, before training (once: every arm starts there) and
after each arm. No HTTP, no queue: the services' cores, called directly.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.batching import differs
from loom.contracts.wire import (
    Group,
    LossSpec,
    ReflectParams,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    SamplingParams,
    TrainBatch,
)

# the engine's prefix KV cache: one entry per live sequence of a step (8 prompts x 8 responses by
# default) lets every streaming round reuse its own prefix
CACHE_ENTRIES = 256

# (problem, sampling, group id) -> the rollout request of the bench's format
MakeRequest = Callable[[Any, SamplingParams, str], RolloutRequest]
# one group -> per-trajectory measures (e.g. streaming tokens), every trajectory the same keys
Measure = Callable[[Group], list[dict[str, float]]]


@dataclass
class LoopConfig:
    model: Path
    steps: int
    prompts: int  # per step
    group: int  # responses per prompt
    seed: int
    lr: float
    temperature: float
    max_tokens: int
    eval_prompts: int
    warmup: int = 0
    # DAPO's dynamic sampling as verl's ``algorithm.filter_groups`` (without its re-sampling): a group
    # whose reward component of this name is the same for every response is left out of the update
    filter_groups: str | None = None


@dataclass
class Arm:
    name: str
    estimator: str
    spec: RewardSpec
    estimator_params: dict[str, Any] = field(default_factory=dict)
    reflect: ReflectParams | None = None  # REA-RL: add gold-truncation revisions before training
    loss: dict[str, Any] = field(default_factory=dict)  # LossSpec fields of this arm (e.g. hrpo_lambda)


@dataclass
class Eval:
    accuracy: float
    means: dict[str, float]


@dataclass
class StepLog:
    step: int
    reward: float
    accuracy: float
    means: dict[str, float]
    skipped: bool
    seconds: float
    revisions: int = 0
    trained_groups: int = 0  # groups in the update (all of them unless cfg.filter_groups drops some)


@dataclass
class ArmResult:
    arm: Arm
    steps: list[StepLog]
    after: Eval
    weight_change: float  # ||w - w_start|| / ||w_start|| over every parameter
    policy_version: int  # the version the engine serves at the end (0: still the start checkpoint)
    seconds: float


class Scorer:
    """The reward service's core in-process; its isolated verifier pool starts only if an item needs
    math-verify (Countdown and arithmetic use Loom's exact verifier)."""

    def __init__(self) -> None:
        self._pool: Any = None

    def verify(self, items: Sequence[Any], timeout_s: int) -> list[Any]:
        if self._pool is None:
            from reward_svc.pool import VerifierPool

            self._pool = VerifierPool(1)
        return list(self._pool.check_many(items, timeout_s))

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        from reward_svc.core import score_group

        return score_group(group, spec, self.verify)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def generate(engine: Any, requests: Sequence[RolloutRequest]) -> list[Group]:
    """Every request's group through the rollout core, concurrently (the torch engine batches them)."""
    from loom.contracts.settings import get_settings
    from rollout_svc.rollout import generate_group

    settings, tok = get_settings(), engine.tokenizer

    async def run() -> list[Group]:
        return list(
            await asyncio.gather(*(generate_group(r, engine, lambda: tok, settings) for r in requests))
        )

    return asyncio.run(run())


@dataclass
class InProcessServices:
    """reflect_svc's ``Services`` over the rollout and reward cores in this process."""

    engine: Any
    scorer: Scorer

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        from reward_svc.match import MatchRequest, finish_matches, plan_matches

        req = MatchRequest(label=group.label, task=group.task, meta=dict(group.meta), texts=texts)
        decided, math_items = plan_matches(req)
        verdicts = self.scorer.verify([m for _, m in math_items], req.timeout_s) if math_items else []
        return [
            v.status == "ok" and v.correct for v in finish_matches(decided, math_items, verdicts).verdicts
        ]

    def label(self, prompt: str, n_chunks: int) -> Any:
        raise NotImplementedError("the gold detector needs no reflection model")

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        return generate(self.engine, requests)

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        return self.scorer.score(group, spec)


def sampling_seed(seed: int, step: int, prompt: int) -> int:
    """The same seed for (step, prompt) in every arm."""
    return (seed * 1_000_003 + step * 10_007 + prompt * 101) % (2**31)


def revise(group: Group, params: ReflectParams, services: InProcessServices) -> tuple[Group, int]:
    """REA-RL's revisions (reflect_svc, gold detector): the group with its kept revisions after their
    originals. Revision texts are derived as the rollout core derives them (markers kept), so
    originals and revisions are scored alike."""
    from reflect_svc.revise import revise_group
    from rollout_svc.rollout import with_text

    tok = services.engine.tokenizer
    result = revise_group(group, params, services, tok)
    out = result.group
    revised = 0
    for t in out.trajectories:
        if t.parent_id is not None and "revision_of" in t.meta:
            t.text = None
            revised += 1
    return with_text(out, lambda: tok), revised


def evaluate(
    engine: Any,
    problems: Sequence[Any],
    make_request: MakeRequest,
    spec: RewardSpec,
    measure: Measure,
    max_tokens: int,
) -> Eval:
    """Greedy decoding of each problem: accuracy (the reward core's accuracy component) and the mean
    of every measure."""
    scorer = Scorer()
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=max_tokens)
    groups = generate(engine, [make_request(p, greedy, f"eval{i}") for i, p in enumerate(problems)])
    correct, rows = [], []
    for g in groups:
        res = scorer.score(g, spec)
        correct += [r.components.get("accuracy", 0.0) for r in res.rewards]
        rows += measure(g)
    scorer.close()
    return Eval(statistics.fmean(correct), _means(rows))


def _means(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    if not rows:
        return {}
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


def run_arm(
    cfg: LoopConfig,
    arm: Arm,
    train: Sequence[Any],
    held_out: Sequence[Any],
    make_request: MakeRequest,
    measure: Measure,
    log: Callable[[str], None] = print,
) -> ArmResult:
    """``cfg.steps`` RL steps of ``arm`` from ``cfg.model``; prompts ``train[step*P:(step+1)*P]``."""
    from learner.config import LearnerSettings
    from learner.train import Learner
    from rollout_svc.engines.torch import TorchEngine

    t0 = time.perf_counter()
    scorer = Scorer()
    # processed log-probs: the tempered policy's, which the learner recomputes at loss.temperature
    engine = TorchEngine(cfg.model, logprobs_mode="processed", cache_entries=CACHE_ENTRIES)
    services = InProcessServices(engine, scorer)
    loss = LossSpec(lr=cfg.lr, temperature=cfg.temperature, warmup_steps=cfg.warmup, **arm.loss)
    steps: list[StepLog] = []
    with tempfile.TemporaryDirectory(prefix=f"loom-{arm.name}-") as tmp:
        learner = Learner(
            LearnerSettings(model=cfg.model, store=Path(tmp), save_optimizer=False, keep_versions=1)
        )
        start = {k: v.detach().clone() for k, v in learner.model.state_dict().items()}
        for step in range(cfg.steps):
            ts = time.perf_counter()
            problems = train[step * cfg.prompts : (step + 1) * cfg.prompts]
            requests = [
                make_request(
                    p,
                    SamplingParams(
                        n=cfg.group,
                        temperature=cfg.temperature,
                        max_tokens=cfg.max_tokens,
                        seed=sampling_seed(cfg.seed, step, i),
                    ),
                    f"s{step}p{i}",
                )
                for i, p in enumerate(problems)
            ]
            groups = generate(engine, requests)
            rows = [m for g in groups for m in measure(g)]  # the sampled originals, before revisions
            revisions = 0
            if arm.reflect is not None:
                revised = []
                for i, g in enumerate(groups):
                    params = arm.reflect.model_copy(update={"seed": sampling_seed(cfg.seed + 1, step, i)})
                    g2, n = revise(g, params, services)
                    revised.append(g2)
                    revisions += n
                groups = revised
            rewards = [scorer.score(g, arm.spec) for g in groups]
            originals = [
                r
                for g, res in zip(groups, rewards, strict=True)
                for t, r in zip(g.trajectories, res.rewards, strict=True)
                if "revision_of" not in t.meta
            ]
            if cfg.filter_groups is not None:
                groups, rewards = filter_groups(groups, rewards, cfg.filter_groups)
            skipped = not groups
            if groups:
                batch = TrainBatch(
                    step=step,
                    groups=groups,
                    rewards=rewards,
                    estimator=arm.estimator,  # type: ignore[arg-type]
                    estimator_params=arm.estimator_params,
                    loss=loss,
                )
                res = learner.train_step(batch)
                skipped = bool(res.metrics.get("skipped"))
                if res.policy is not None and res.policy.version != engine.policy_version:
                    engine.load_policy_sync(res.policy)
            entry = StepLog(
                step=step,
                reward=statistics.fmean(r.total for r in originals),
                accuracy=statistics.fmean(r.components.get("accuracy", 0.0) for r in originals),
                means=_means(rows),
                skipped=skipped,
                seconds=time.perf_counter() - ts,
                revisions=revisions,
                trained_groups=len(groups),
            )
            steps.append(entry)
            shown = " ".join(f"{k} {v:.1f}" for k, v in entry.means.items())
            log(
                f"  [{arm.name}] step {step}: reward {entry.reward:+.3f} acc {entry.accuracy:.2f} {shown}"
                + (f" revisions {revisions}" if arm.reflect is not None else "")
                + (f" groups trained {len(groups)}/{cfg.prompts}" if cfg.filter_groups is not None else "")
                + (" (no update)" if entry.skipped else "")
                + f" ({entry.seconds:.1f} s)"
            )
        change = weight_change(start, learner.model.state_dict())
    after = evaluate(engine, held_out, make_request, arm.spec, measure, cfg.max_tokens)
    scorer.close()
    engine.stop_scheduler()
    return ArmResult(arm, steps, after, change, engine.policy_version, time.perf_counter() - t0)


def filter_groups(
    groups: Sequence[Group], rewards: Sequence[RewardResult], component: str
) -> tuple[list[Group], list[RewardResult]]:
    """The groups (and their rewards) whose responses differ in reward component ``component``: DAPO's
    dynamic sampling filter (``cfg.filter_groups``, loom.batching.differs)."""
    kept = [i for i, res in enumerate(rewards) if differs(res, component)]
    return [groups[i] for i in kept], [rewards[i] for i in kept]


def weight_change(start: dict[str, Any], now: dict[str, Any]) -> float:
    """||w - w_start|| / ||w_start|| over every parameter tensor (0 for an untrained policy)."""
    diff = base = 0.0
    for k, w0 in start.items():
        w = now[k].detach().to(w0.device)
        diff += float(((w - w0).float() ** 2).sum())
        base += float((w0.float() ** 2).sum())
    return math.sqrt(diff) / math.sqrt(base) if base > 0 else 0.0


def base_eval(
    cfg: LoopConfig, held_out: Sequence[Any], make_request: MakeRequest, spec: RewardSpec, measure: Measure
) -> Eval:
    from rollout_svc.engines.torch import TorchEngine

    engine = TorchEngine(cfg.model, logprobs_mode="processed", cache_entries=CACHE_ENTRIES)
    try:
        return evaluate(engine, held_out, make_request, spec, measure, cfg.max_tokens)
    finally:
        engine.stop_scheduler()


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


def problems_for(model: str, n: int, seed: int, split: str, kind: str = "countdown") -> list[Any]:
    """The model's own problems: the search and stream models' Countdown (zoo.search), else the
    tiny model's."""
    if model in ("search", "stream", "reflect") or "search" in Path(model).parts[-3:]:
        from zoo.search import search_problems

        return search_problems(kind, n, seed, split)  # type: ignore[arg-type]
    from zoo.tiny import tiny_problems

    return tiny_problems(kind, n, seed, split)  # type: ignore[arg-type]


def countdown_label(problem: Any) -> tuple[str, str]:
    """(label, task) as the gateway's built-in datasets give them (reward_svc's exact verifiers)."""
    import json

    if problem.kind == "countdown":
        return json.dumps({"numbers": list(problem.numbers), "target": problem.target}), "countdown"
    return problem.gold, "arithmetic"


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


def loop_config(args: Any) -> LoopConfig:
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
    )


# ------------------------------------------------------------------------------------ several seeds


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
