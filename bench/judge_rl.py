"""RL with the judge as the only reward (docs/benchmarks/judge.md): does training the search model on
the built-in judge's verdicts (zoo/search/judge.py) raise its exact accuracy on held-out problems?

Each step is the product's RL step (``gateway.step.rl_step``) through ``launch.inprocess.InProcessStages``
(bench/rl_loop.py): the search model samples plain traces for Countdown problems of its train split,
the reward core's ``judge`` component (template ``arith``, ``logprob`` mode: P(yes)) scores them by
asking the judge checkpoint served by a real ``loom engine`` or vLLM CPU process over HTTP (named in
``LOOM_REWARD_JUDGES``), GRPO trains one learner. The reward spec is the judge alone (weight 1); the
exact verifier (``loom/exact.py``, the reward core's ``accuracy``) is read only to report: held-out
accuracy before and after (greedy, and ``--eval-samples`` responses a problem at the training
temperature: the policy RL trains is the sampled one), and the sampled responses' exact accuracy per
step beside the judge's reward. The control arm ("accuracy") trains on the exact verifier's reward with
the same prompts and sampling seeds. The defaults are the setting where that control rises (a learning
rate of 1e-4 or more degrades this 2.7M-parameter policy within 30 steps: the benchmark page).

    .venv/bin/python bench/judge_rl.py --seed S --judge-server vllm --json OUT.json  # one seed
    .venv/bin/python bench/judge_rl.py --seed S --arms judge --json OUT.json  # one arm; join by seed
    .venv/bin/python bench/judge_rl.py --summarize A.json B.json C.json  # the seeds as one table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import rl_loop, rl_report  # noqa: E402
from bench.rollout import Procs, start_engine_server  # noqa: E402
from loom.contracts.wire import Group, RewardComponent, RewardSpec, RolloutRequest, SamplingParams  # noqa: E402

JUDGE_PARAMS = {"judge": "judge", "template": "arith", "mode": "logprob", "max_tokens": 4, "timeout_s": 300}
ACCURACY = RewardSpec(components=[RewardComponent(name="accuracy")])


def judge_spec() -> RewardSpec:
    return RewardSpec(components=[RewardComponent(name="judge", weight=1.0, params=JUDGE_PARAMS)])


def plain_request(problem: Any, sampling: SamplingParams, group_id: str) -> RolloutRequest:
    """The prompt the judge was trained on (zoo/search/judge.py: ``[plain] {question}``)."""
    label, task = rl_loop.countdown_label(problem)
    return RolloutRequest(
        group_id=group_id,
        mode="plain",
        prompt=f"[plain] {problem.text}\n",
        sampling=sampling,
        label=label,
        task=task,  # type: ignore[arg-type]
    )


def exact_measure(group: Group) -> list[dict[str, float]]:
    """Per trajectory: the exact verifier's verdict on its last boxed answer, and its tokens."""
    from loom.answers import last_boxed
    from loom.exact import check_countdown

    label = json.loads(group.label or "{}")
    out = []
    for t in group.trajectories:
        boxed = last_boxed(t.text or "")
        right = boxed is not None and check_countdown(boxed, list(label["numbers"]), label["target"])
        out.append({"exact": float(right), "tokens": float(len(t.completion_ids))})
    return out


def arms(names: Sequence[str]) -> list[rl_loop.Arm]:
    all_arms = {
        "judge": rl_loop.Arm("judge", "grpo", judge_spec(), eval_spec=ACCURACY),
        "accuracy": rl_loop.Arm("accuracy", "grpo", ACCURACY),
    }
    return [all_arms[n] for n in names]


def record(
    cfg: rl_loop.LoopConfig,
    base: rl_report.Eval,
    results: Sequence[rl_report.ArmResult],
    judge_server: str,
    judge_model: str,
) -> dict:
    return {
        "seed": cfg.seed,
        "steps": cfg.steps,
        "prompts": cfg.prompts,
        "group": cfg.group,
        "lr": cfg.lr,
        "max_tokens": cfg.max_tokens,
        "eval": cfg.eval_prompts,
        "start": base.accuracy,
        "start_sampled": base.sampled,
        "eval_samples": cfg.eval_samples,
        "temperature": cfg.temperature,
        "judge_server": judge_server,
        "judge_model": judge_model,
        "arms": {
            r.arm.name: {
                "held_out": r.after.accuracy,
                "held_out_sampled": r.after.sampled,
                "reward": [s.reward for s in r.steps],
                "exact": [s.means.get("exact", 0.0) for s in r.steps],
                "tokens": [s.means.get("tokens", 0.0) for s in r.steps],
                "skipped": sum(s.skipped for s in r.steps),
                "weight_change": r.weight_change,
                "seconds": r.seconds,
            }
            for r in results
        },
    }


def merged(paths: Sequence[Path]) -> list[dict]:
    """One record per seed: the arms of a seed's runs in separate processes (``--arms``) joined, which
    is sound only where they started from the same held-out figures (same seed, same checkpoint)."""
    by_seed: dict[int, dict] = {}
    for path in paths:
        rec = json.loads(path.read_text())
        have = by_seed.setdefault(rec["seed"], {**rec, "arms": {}})
        for key in ("start", "start_sampled", "steps", "prompts", "group", "lr", "eval_samples"):
            if have.get(key) != rec.get(key):
                raise SystemExit(
                    f"{path}: {key} {rec.get(key)} differs from seed {rec['seed']}'s {have.get(key)}"
                )
        have["arms"].update(rec["arms"])
    return [by_seed[k] for k in sorted(by_seed)]


def summarize(paths: Sequence[Path]) -> None:
    recs = merged(paths)
    names = list(recs[0]["arms"])
    print(f"{len(recs)} seeds ({', '.join(str(r['seed']) for r in recs)}), {recs[0]['steps']} steps each")
    readings = [("greedy", "start", "held_out")]
    if recs[0].get("start_sampled") is not None:
        readings.append((f"sampled at T={recs[0]['temperature']}", "start_sampled", "held_out_sampled"))
    for title, start_key, key in readings:
        print(f"held-out exact accuracy, {title}:")
        starts = [r[start_key] for r in recs]
        print(f"  start      {rl_report.mean_se(starts)}   per seed", [round(x, 3) for x in starts])
        for n in names:
            after = [r["arms"][n][key] for r in recs]
            diff = [a - s0 for a, s0 in zip(after, starts, strict=True)]
            print(
                f"  {n:10s} {rl_report.mean_se(after)}   after - start {rl_report.mean_se(diff)}"
                f"  per seed {' '.join(f'{d:+.3f}' for d in diff)}"
            )
    for n in names:
        for key in ("reward", "exact"):
            curve = [statistics.fmean(c) for c in zip(*(r["arms"][n][key] for r in recs), strict=True)]
            print(f"  {n} arm, train {key} per step (mean of seeds): {' '.join(f'{x:.2f}' for x in curve)}")


def shown(e: rl_report.Eval) -> str:
    return f"{e.accuracy:.3f} greedy" + ("" if e.sampled is None else f", {e.sampled:.3f} sampled")


def start_judge(procs: Procs, tmp: Path, server: str, threads: str, model: str = "judge") -> tuple[str, Any]:
    """The judge checkpoint served by ``loom engine`` or the vLLM CPU build: (url, vLLM server or None)."""
    if server == "vllm":
        from bench.judge_agreement import start_vllm

        started = start_vllm(tmp, model)
        if isinstance(started, str):
            raise SystemExit(f"the vLLM judge could not start: {started}")
        return started[1], started[0]
    return start_engine_server(procs, tmp, ["--model", model], LOOM_TORCH_THREADS=threads), None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rl_report.add_loop_args(
        p, steps=40, prompts=16, group=8, lr=3e-5, temperature=1.0, max_tokens=512, eval_n=48, warmup=5,
        eval_samples=4,
    )  # fmt: skip
    p.add_argument("--arms", nargs="+", default=["judge", "accuracy"], choices=("judge", "accuracy"))
    p.add_argument(
        "--judge-model", default="judge", help="the judge checkpoint: a built-in name or a directory"
    )
    p.add_argument("--judge-threads", default="1", help="LOOM_TORCH_THREADS of the judge server")
    p.add_argument(
        "--judge-server",
        choices=("engine", "vllm"),
        default="engine",
        help="what serves the judge checkpoint",
    )
    rl_report.add_seed_args(p)
    args = p.parse_args(argv)
    if args.summarize:
        summarize(args.summarize)
        return 0
    from loom.runtime import configure_process

    rl_report.quiet()
    configure_process()
    cfg = rl_report.loop_config(args)
    train = rl_loop.problems_for(args.model, cfg.steps * cfg.prompts, cfg.seed, "train", "countdown")
    held_out = rl_loop.problems_for(args.model, cfg.eval_prompts, 10_000 + cfg.seed, "test", "countdown")
    t0 = time.perf_counter()
    procs = Procs()
    with tempfile.TemporaryDirectory(prefix="loom-judge-rl-") as d:
        vllm = None
        try:
            url, vllm = start_judge(procs, Path(d), args.judge_server, args.judge_threads, args.judge_model)
            from loom.contracts.reward_settings import get_reward_settings

            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            judges = {"judge": {"url": url, "model": model, "max_concurrency": 32}}
            os.environ["LOOM_REWARD_JUDGES"] = json.dumps(judges)
            get_reward_settings.cache_clear()
            print(
                f"judge-only RL: model {cfg.model}, judge {url}"
                f" ({args.judge_server}), {cfg.steps} steps x {cfg.prompts} prompts x {cfg.group} responses,"
                f" lr {cfg.lr},"
                f" seed {cfg.seed}",
                flush=True,
            )
            base = rl_loop.base_eval(cfg, held_out, plain_request, ACCURACY, exact_measure)
            print(f"start: held-out exact accuracy {shown(base)} ({len(held_out)} problems)", flush=True)
            results = [
                rl_loop.run_arm(cfg, arm, train, held_out, plain_request, exact_measure)
                for arm in arms(args.arms)
            ]
        finally:
            if vllm is not None:
                vllm.stop()
            procs.close()
    for r in results:
        reward = " ".join(f"{s.reward:.2f}" for s in r.steps)
        exact = " ".join(f"{s.means.get('exact', 0.0):.2f}" for s in r.steps)
        print(
            f"{r.arm.name}: held-out {shown(base)} -> {shown(r.after)}; train reward {reward};"
            f" train exact {exact}; {r.seconds:.0f} s"
        )
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json is not None:
        args.json.write_text(
            json.dumps(record(cfg, base, results, args.judge_server, args.judge_model), indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
