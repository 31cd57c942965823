"""REA-RL's comparison (issue 29; REA-RL: Reflection-Aware Online RL for Efficient Reasoning): the
reflection reward with gold truncation against the length reward alone, after the same RL steps from the
same checkpoint, side by side in one run.

Rollouts: the reflect format (``zoo.tiny.reflect_prompt``: solve, state the answer, re-check it) in
plain mode through the rollout core on the in-process torch engine, Countdown problems. Arms (rewards
by the reward core, docs/algorithms.md §1):

- length: ``accuracy`` + ``length_refined`` (REA-RL eq. 4), GRPO: the length reward alone.
- reflection + truncation: REA-RL's additions to it: ``accuracy`` + ``length_refined`` + ``reflection``
  (REA-RL eq. 3: R = min(0, D / D_q - 1) penalises a reflection density below D_q, so that the length
  reward does not buy shortness by dropping reflection), and every sampled group gets REA-RL's
  revisions (reflect_svc.revise, docs/algorithms.md §3) with the ``gold`` detector: the thinking part
  is cut after the first chunk that states the gold answer (at most half of it removed), the forced
  ending appended, the policy completes it; kept revisions join their group and the ``rea`` estimator
  (GRPO over originals and revisions, REA-RL §4.2) trains on both.

Printed per arm (and the start checkpoint): held-out greedy accuracy, response tokens and reflections
per response (REA-RL eq. 3's count, on the thinking part), the sampled responses' tokens and accuracy
on the first and the last step, revisions kept, and how far the weights moved. On the tiny and
search models' reflect traces the answer is stated before the first re-check, so a gold-truncated
revision keeps no reflection and its reflection reward is -1 (D = 0), below its correct original's;
this pushes the second arm towards longer, more reflective responses. The ``reflect`` model
(zoo/search/reflect.py) reflects inside its search before the answer, so its revisions keep those
reflections and lose only the re-checks, as REA-RL's do. REA-RL's direction:
the length reward alone shortens responses by dropping reflection, at a cost in accuracy; with the
reflection reward and revisions, responses are short while keeping reflection and accuracy.

    python bench/rea.py [--model reflect|search|tiny|DIR] [--task countdown|arith] [--steps 24] [--prompts 8]
                        [--group 8] [--seed 0] [--lr 1e-4] [--warmup 5] [--temperature 1.0]
                        [--max-tokens 320] [--min-chunk-tokens 8] [--answer-tokens 64]
                        [--reflection-weight 1.0] [--eval 32] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# `python bench/rea.py` puts bench/ first on sys.path, where bench/learner.py would shadow the learner
# package: the repository root goes there instead
_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _BENCH]

from bench import rl_loop, rl_report  # noqa: E402
from loom.contracts.wire import (  # noqa: E402
    Group,
    ReflectParams,
    RewardComponent,
    RewardSpec,
    RolloutRequest,
    SamplingParams,
)


def length_spec() -> RewardSpec:
    return RewardSpec(components=[RewardComponent(name="accuracy"), RewardComponent(name="length_refined")])


def reflection_spec(weight: float = 1.0) -> RewardSpec:
    return RewardSpec(
        components=[
            RewardComponent(name="accuracy"),
            RewardComponent(name="length_refined"),
            RewardComponent(name="reflection", weight=weight),
        ]
    )


def arms(
    min_chunk_tokens: int, temperature: float, answer_tokens: int, reflection_weight: float = 1.0
) -> list[rl_loop.Arm]:
    truncation = ReflectParams(
        detector="gold",
        min_chunk_tokens=min_chunk_tokens,
        max_chunk_tokens=max(128, min_chunk_tokens),
        max_tokens=answer_tokens,
        temperature=temperature,
    )  # the revised groups are scored once with the arm's reward spec (gateway/step.py)
    return [
        rl_loop.Arm("length", "grpo", length_spec()),
        rl_loop.Arm("reflection+truncation", "rea", reflection_spec(reflection_weight), reflect=truncation),
    ]


def reflect_request(problem: Any, sampling: SamplingParams, group_id: str) -> RolloutRequest:
    from zoo.tiny import reflect_prompt

    label, task = rl_loop.countdown_label(problem)
    return RolloutRequest(
        group_id=group_id,
        mode="plain",
        prompt=reflect_prompt(problem),
        sampling=sampling,
        label=label,
        task=task,  # type: ignore[arg-type]
    )


def response_measures(group: Group) -> list[dict[str, float]]:
    """Per trajectory: completion tokens and reflections in its thinking part (the reward core's
    counting, REA-RL eq. 3)."""
    from loom.formats import REFLECTION_KEYWORDS
    from reward_svc.reflection import count_reflections
    from reward_svc.trace import thinking_text

    return [
        {
            "tokens": float(len(t.completion_ids)),
            "reflections": float(count_reflections(thinking_text(t.text or ""), list(REFLECTION_KEYWORDS))),
        }
        for t in group.trajectories
    ]


HEADER = (
    "arm",
    "held-out acc",
    "tokens",
    "reflections",
    "train tokens (first -> last)",
    "train acc (first -> last)",
    "revisions kept",
    "weights moved",
    "s",
)


def table_rows(base: rl_report.Eval, results: Sequence[rl_report.ArmResult]) -> list[list[str]]:
    rows = [
        ["start", f"{base.accuracy:.3f}", f"{base.means['tokens']:.1f}", f"{base.means['reflections']:.2f}"]
        + ["", "", "", "0", ""]
    ]
    for r in results:
        first, last = r.steps[0], r.steps[-1]
        rows.append(
            [
                r.arm.name,
                f"{r.after.accuracy:.3f}",
                f"{r.after.means['tokens']:.1f}",
                f"{r.after.means['reflections']:.2f}",
                f"{first.means['tokens']:.1f} -> {last.means['tokens']:.1f}",
                f"{first.accuracy:.2f} -> {last.accuracy:.2f}",
                str(sum(s.revisions for s in r.steps)) if r.arm.reflect is not None else "-",
                f"{r.weight_change:.2e}",
                f"{r.seconds:.0f}",
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[rl_report.ArmResult]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rl_report.add_loop_args(
        p, steps=24, prompts=8, group=8, lr=1e-4, temperature=1.0, max_tokens=320, eval_n=32, warmup=5
    )
    p.add_argument(
        "--min-chunk-tokens", type=int, default=8, help="truncation chunks (docs/algorithms.md §3)"
    )
    p.add_argument("--answer-tokens", type=int, default=64, help="budget of a revision's completion")
    p.add_argument(
        "--reflection-weight",
        type=float,
        default=1.0,
        help="weight of the reflection reward (a revision cut before its first reflection scores -1)",
    )
    rl_report.add_seed_args(p)
    args = p.parse_args(argv)
    if args.summarize:
        title = "REA-RL: reflection + truncation vs length reward"
        rl_report.write_summary(
            args.summarize, args.out, title, against="length", arm="reflection+truncation"
        )
        return []
    from loom.runtime import configure_process

    rl_report.quiet()
    configure_process()
    cfg = rl_report.loop_config(args)
    t0 = time.perf_counter()
    train = rl_loop.problems_for(args.model, cfg.steps * cfg.prompts, cfg.seed, "train", args.task)
    held_out = rl_loop.problems_for(args.model, cfg.eval_prompts, 10_000 + cfg.seed, "test", args.task)
    print(
        f"REA-RL: reflection reward + gold truncation vs length reward, model {cfg.model}, {cfg.steps} steps"
        f" x {cfg.prompts} prompts x {cfg.group} responses, lr {cfg.lr}, temperature {cfg.temperature},"
        f" seed {cfg.seed}",
        flush=True,
    )
    base = rl_loop.base_eval(cfg, held_out, reflect_request, length_spec(), response_measures)
    print(
        f"start: held-out acc {base.accuracy:.3f}, {base.means['tokens']:.1f} tokens,"
        f" {base.means['reflections']:.2f} reflections",
        flush=True,
    )
    results = [
        rl_loop.run_arm(cfg, arm, train, held_out, reflect_request, response_measures)
        for arm in arms(args.min_chunk_tokens, cfg.temperature, args.answer_tokens, args.reflection_weight)
    ]
    rows = table_rows(base, results)
    print(f"\nafter {cfg.steps} steps ({len(held_out)} held-out problems, greedy; tokens per response):")
    print(rl_report.text_table(HEADER, rows))
    length, rea = (r.after for r in results)
    print(
        f"reflection+truncation - length: tokens {rea.means['tokens'] - length.means['tokens']:+.1f},"
        f" reflections {rea.means['reflections'] - length.means['reflections']:+.2f},"
        f" accuracy {rea.accuracy - length.accuracy:+.3f}"
        " (REA-RL: short responses that keep their reflections, accuracy kept)"
    )
    print(f"total {time.perf_counter() - t0:.0f} s")
    rl_report.write_record(args.json, cfg, base, results)
    if args.out is not None:
        title = f"REA-RL: reflection + truncation vs length reward, {args.model} model, {cfg.steps} steps"
        for line in rl_report.write_out(
            args.out,
            title,
            rl_report.markdown_table(HEADER, rows),
            results,
            [
                ("train tokens", "tokens"),
                ("train reflections", "reflections"),
                ("train accuracy", "accuracy"),
            ],
        ):
            print(line)
    return results


if __name__ == "__main__":
    main()
