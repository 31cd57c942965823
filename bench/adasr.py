"""AdaSR's comparison (issue 29; AdaSR arXiv 2606.14694): HRPO vs GRPO on the streaming format, after the
same RL steps from the same checkpoint, side by side in one run.

Rollouts: streaming mode (rollout_svc.modes.streaming, through the rollout core on the in-process torch
engine): the Countdown problem is revealed sentence by sentence (``zoo.tiny.traces.stream_sentences``),
the model writes a thought after each (the streaming phase), then the deep phase after the connector,
then the answer. Rewards: AdaSR's, computed by the reward core (docs/algorithms.md §1.1-1.4):
``accuracy``, ``format_stream``, ``format_deep``, ``length_stream``, ``length_deep``, ``efficiency``.
Both arms get the same components; they differ only in the estimator (docs/algorithms.md §5.1):

- GRPO: one scalar per trajectory, the components weighted as AdaSR weights them (accuracy 1, format
  2, length and efficiency beta = 0.05), group-normalised; every token gets it.
- HRPO: each component normalised over the group first (AdaSR eq. 8), A^s on the streaming tokens,
  A^d on the deep ones, A^g on all, with the hierarchical loss (eq. 5/10); the same coefficients as
  HRPO's ``w_acc``, ``w_fmt`` and ``beta``.

Printed per arm (and the start checkpoint): held-out greedy accuracy, the streaming-phase length (mean
trained tokens the model wrote in its stream segments while reading: the tokens A^s covers) and the
deep-phase length on the held-out problems, the same lengths of the sampled training responses on the
first and the last step, and how far the weights moved. AdaSR's direction: HRPO shortens the
streaming phase at equal accuracy.

    python bench/adasr.py [--model search|stream|tiny|DIR] [--task countdown|arith] [--steps 24]
                          [--prompts 8] [--group 8] [--seed 0] [--lr 1e-4] [--warmup 5]
                          [--temperature 1.0] [--max-tokens 256] [--segment-cap 32] [--eval 32]
                          [--hrpo-lambda 0.05] [--grpo-beta 0.05] [--filter-groups accuracy]
                          [--out FILE.md] [--json RUN.json]
    python bench/adasr.py --summarize RUN.json ... [--out FILE.md]   (seeds: mean ± standard error)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# `python bench/adasr.py` puts bench/ first on sys.path, where bench/learner.py would shadow the learner
# package: the repository root goes there instead
_BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(_BENCH.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _BENCH]

from bench import rl_loop, rl_report  # noqa: E402
from loom.contracts.wire import Group, RewardComponent, RewardSpec, RolloutRequest, SamplingParams  # noqa: E402

# AdaSR Table 6 coefficients: in GRPO's scalar reward as component weights, in HRPO as w_acc, w_fmt,
# beta on the normalised components (docs/algorithms.md §1.6)
W_ACC, W_FMT, BETA = 1.0, 2.0, 0.05


def reward_spec(beta: float = BETA) -> RewardSpec:
    """AdaSR's components; ``beta`` weights the length and efficiency terms in GRPO's summed reward
    (0: AdaSR Table 3's "Acc + format" column)."""
    return RewardSpec(
        components=[
            RewardComponent(name="accuracy", weight=W_ACC),
            RewardComponent(name="format_stream", weight=W_FMT),
            RewardComponent(name="format_deep", weight=W_FMT),
            RewardComponent(name="length_stream", weight=beta),
            RewardComponent(name="length_deep", weight=beta),
            RewardComponent(name="efficiency", weight=beta),
        ]
    )


def arms(hrpo_lambda: float = 0.05, grpo_beta: float = BETA) -> list[rl_loop.Arm]:
    """GRPO and HRPO; ``hrpo_lambda`` is HRPO's local weight λ (AdaSR eq. 5, default 0.05),
    ``grpo_beta`` the weight of the length terms in GRPO's reward (AdaSR's β, or 0 for none)."""
    hrpo = {"beta": BETA, "w_acc": W_ACC, "w_fmt": W_FMT}
    return [
        rl_loop.Arm("grpo", "grpo", reward_spec(grpo_beta)),
        rl_loop.Arm("hrpo", "hrpo", reward_spec(), hrpo, loss={"hrpo_lambda": hrpo_lambda}),
    ]


class StreamRequest:
    """A Countdown problem as a streaming-mode request (its sentences revealed one by one), as the
    gateway's built-in datasets build it (gateway/datasets.py)."""

    def __init__(self, segment_cap: int, answer_max_tokens: int = 32) -> None:
        self.segment_cap, self.answer_max_tokens = segment_cap, answer_max_tokens

    def __call__(self, problem: Any, sampling: SamplingParams, group_id: str) -> RolloutRequest:
        from zoo.tiny import STREAM_HEADER
        from zoo.tiny.traces import stream_sentences

        label, task = rl_loop.countdown_label(problem)
        return RolloutRequest(
            group_id=group_id,
            mode="streaming",
            prompt=STREAM_HEADER,
            sampling=sampling,
            label=label,
            task=task,  # type: ignore[arg-type]
            mode_params={
                "sentences": stream_sentences(problem),
                "segment_cap": self.segment_cap,
                "answer_max_tokens": self.answer_max_tokens,
            },
        )


def phase_lengths(group: Group) -> list[dict[str, float]]:
    """Per trajectory: the trained tokens of its stream segments (the streaming phase, A^s's tokens;
    forced end markers are not the model's) and of its deep segment."""
    out = []
    for t in group.trajectories:
        mask = t.loss_mask or [1] * len(t.completion_ids)
        lengths = {"stream": 0.0, "deep": 0.0}
        for s in t.segments:
            if s.kind in lengths:
                lengths[s.kind] += sum(mask[s.start : s.end])
        out.append(lengths)
    return out


HEADER = (
    "arm",
    "held-out acc",
    "stream tok",
    "deep tok",
    "train stream tok (first -> last)",
    "train deep tok (first -> last)",
    "train acc (first -> last)",
    "weights moved",
    "s",
)


def table_rows(base: rl_report.Eval, results: Sequence[rl_report.ArmResult]) -> list[list[str]]:
    rows = [
        ["start", f"{base.accuracy:.3f}", f"{base.means['stream']:.1f}", f"{base.means['deep']:.1f}"]
        + ["", "", "", "0", ""]
    ]
    for r in results:
        first, last = r.steps[0], r.steps[-1]
        rows.append(
            [
                r.arm.name,
                f"{r.after.accuracy:.3f}",
                f"{r.after.means['stream']:.1f}",
                f"{r.after.means['deep']:.1f}",
                f"{first.means['stream']:.1f} -> {last.means['stream']:.1f}",
                f"{first.means['deep']:.1f} -> {last.means['deep']:.1f}",
                f"{first.accuracy:.2f} -> {last.accuracy:.2f}",
                f"{r.weight_change:.2e}",
                f"{r.seconds:.0f}",
            ]
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[rl_report.ArmResult]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    rl_report.add_loop_args(
        p, steps=24, prompts=8, group=8, lr=1e-4, temperature=1.0, max_tokens=256, eval_n=32, warmup=5
    )
    p.add_argument("--segment-cap", type=int, default=32, help="tokens per streaming thought")
    p.add_argument("--hrpo-lambda", type=float, default=0.05, help="HRPO's local weight λ (AdaSR eq. 5)")
    p.add_argument(
        "--grpo-beta",
        type=float,
        default=BETA,
        help="weight of the length and efficiency rewards in GRPO's summed reward (0: accuracy + format"
        " only, AdaSR Table 3); HRPO keeps β = 0.05",
    )
    rl_report.add_seed_args(p)
    args = p.parse_args(argv)
    if args.summarize:
        rl_report.write_summary(args.summarize, args.out, "AdaSR: HRPO vs GRPO", against="grpo", arm="hrpo")
        return []
    from loom.runtime import configure_process

    rl_report.quiet()
    configure_process()
    cfg = rl_report.loop_config(args)
    t0 = time.perf_counter()
    train = rl_loop.problems_for(args.model, cfg.steps * cfg.prompts, cfg.seed, "train", args.task)
    held_out = rl_loop.problems_for(args.model, cfg.eval_prompts, 10_000 + cfg.seed, "test", args.task)
    make = StreamRequest(args.segment_cap)
    print(
        f"AdaSR: HRPO vs GRPO on streaming rollouts, model {cfg.model}, {cfg.steps} steps x {cfg.prompts}"
        f" prompts x {cfg.group} responses, lr {cfg.lr}, temperature {cfg.temperature}, seed {cfg.seed},"
        f" HRPO lambda {args.hrpo_lambda}, GRPO length weight {args.grpo_beta}",
        flush=True,
    )
    base = rl_loop.base_eval(cfg, held_out, make, reward_spec(), phase_lengths)
    print(
        f"start: held-out acc {base.accuracy:.3f}, stream {base.means['stream']:.1f} tok,"
        f" deep {base.means['deep']:.1f} tok",
        flush=True,
    )
    results = [
        rl_loop.run_arm(cfg, arm, train, held_out, make, phase_lengths)
        for arm in arms(args.hrpo_lambda, args.grpo_beta)
    ]
    rows = table_rows(base, results)
    print(
        f"\nafter {cfg.steps} steps ({len(held_out)} held-out problems, greedy; tokens: trained tokens per"
        " response; 'stream' = the streaming phase, A^s's tokens):"
    )
    print(rl_report.text_table(HEADER, rows))
    grpo, hrpo = results
    print(
        f"HRPO - GRPO: stream {hrpo.after.means['stream'] - grpo.after.means['stream']:+.1f} tok,"
        f" deep {hrpo.after.means['deep'] - grpo.after.means['deep']:+.1f} tok,"
        f" accuracy {hrpo.after.accuracy - grpo.after.accuracy:+.3f}"
        " (AdaSR: a shorter streaming phase at equal accuracy)"
    )
    print(f"total {time.perf_counter() - t0:.0f} s")
    rl_report.write_record(args.json, cfg, base, results)
    if args.out is not None:
        title = f"AdaSR: HRPO vs GRPO, {args.model} model, {cfg.steps} steps"
        for line in rl_report.write_out(
            args.out,
            title,
            rl_report.markdown_table(HEADER, rows),
            results,
            [
                ("train stream tokens", "stream"),
                ("train deep tokens", "deep"),
                ("train accuracy", "accuracy"),
            ],
        ):
            print(line)
    return results


if __name__ == "__main__":
    main()
