"""Reflection truncation on an overthinking corpus (REA-RL Table 1 / Table 9 in miniature).

Corpus: Loom's reflective traces of tiny-model problems (zoo/tiny/traces.py ``reflect_trace``): each
solves the problem, states the answer, then keeps re-checking ("Wait, let me check", "Alternatively",
"But ...", "Hmm ...") 1 to 5 times (``--checks``; the tiny model was trained on 0 to 3) before
``</think>`` and the boxed answer; every trace is correct by construction. How much of a trace is
overthinking varies with its number of checks, as in real overthinking, so one fixed ratio cannot
fit every trace. (The tiny
policy's own reflective samples are almost never correct, so they cannot form a "solved" corpus.)

Every method cuts the thinking part (never more than half of it), appends the forced ending, and the
tiny model completes it: the torch engine in-process through ``rollout_svc.rollout.generate_group``
(the rollout service's core), greedy, budget 256. Originals and revisions are scored by the reward
service's core with its isolated verifier pool; the gold detector's chunk verdicts come from the
reward service's match core on the same pool. Methods, side by side in one run:

- original: the trace as it is (no revision);
- full+end: the whole thinking kept, forced ending, completed by the policy (no tokens removed: what
  the policy does with the forced ending alone);
- gold / heuristic k=1 / heuristic k=5: the detectors;
- fixed: fixed truncation keeping 1 - (gold's removed ratio) of the thinking, at the nearest line end.

Accuracy counts every sample: a truncated sample by its revision, an untouched one by its original.

    python -m bench.reflect [--n 100] [--min-chunk-tokens 32 8]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from loom.contracts.settings import get_settings
from loom.contracts.wire import Group, ReflectParams, RewardResult, RewardSpec, RolloutRequest, Trajectory
from loom.runtime import configure_process


@dataclass
class BenchServices:
    """The real cores of the rollout and reward services, in-process (no HTTP hop)."""

    engine: Any
    pool: Any

    def match(self, group: Group, texts: list[str]) -> list[bool]:
        from reward_svc.match import MatchRequest, finish_matches, plan_matches

        req = MatchRequest(label=group.label, task=group.task, meta=dict(group.meta), texts=texts)
        decided, math = plan_matches(req)
        verdicts = self.pool.check_many([m for _, m in math], req.timeout_s) if math else []
        return [v.status == "ok" and v.correct for v in finish_matches(decided, math, verdicts).verdicts]

    def label(self, prompt: str, n_chunks: int) -> Any:
        raise NotImplementedError("no reflection model in this benchmark")

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        from rollout_svc.rollout import generate_group

        settings = get_settings()
        tok = self.engine.tokenizer

        async def run() -> list[Group]:
            return [await generate_group(r, self.engine, lambda: tok, settings) for r in requests]

        return asyncio.run(run())

    def score(self, group: Group, spec: RewardSpec) -> RewardResult:
        from reward_svc.core import score_group

        return score_group(group, spec, self.pool.check_many)


def corpus(tok: Any, n: int, checks: tuple[int, int] = (1, 5)) -> list[Group]:
    from zoo.tiny import tiny_problems
    from zoo.tiny.traces import reflect_trace

    groups = []
    for kind in ("arith", "countdown"):
        for k, p in enumerate(tiny_problems(kind, n, 2024, "test")):  # type: ignore[arg-type]
            prompt, completion = reflect_trace(p, random.Random(k), checks)
            gid = f"{kind}{k}"
            ids = tok.encode(completion.text, add_special_tokens=False)
            traj = Trajectory(
                id=f"{gid}.0",
                group_id=gid,
                prompt_ids=tok.encode(prompt.text, add_special_tokens=False),
                completion_ids=ids,
                logprobs=[0.0] * len(ids),
                text=completion.text,
            )
            meta = {"numbers": list(p.numbers), "target": p.target} if kind == "countdown" else {}
            task = "countdown" if kind == "countdown" else "arithmetic"
            groups.append(
                Group(id=gid, prompt=prompt.text, label=p.gold, task=task, meta=meta, trajectories=[traj])
            )  # type: ignore[arg-type]
    return groups


@dataclass
class Row:
    name: str
    truncated: int = 0
    think: int = 0
    removed: int = 0
    correct: int = 0
    rev_correct: int = 0
    orig_tokens: int = 0
    new_tokens: int = 0
    n: int = 0
    seconds: float = 0.0


def run_method(
    name: str, groups: list[Group], params: ReflectParams, services: BenchServices, tok: Any
) -> Row:
    from reflect_svc.revise import is_correct, revise_group

    row = Row(name)
    t0 = time.perf_counter()
    for g in groups:
        res = revise_group(g, params.model_copy(update={"keep_discarded": True}), services, tok)
        info = res.revisions[0]
        orig = g.trajectories[0]
        row.n += 1
        row.think += info.think_tokens
        row.orig_tokens += len(orig.completion_ids)
        if info.status == "truncated":
            rev = next(t for t in res.group.trajectories if t.id == info.revision_id)
            row.truncated += 1
            row.removed += info.removed_tokens
            row.rev_correct += bool(info.revision_correct)
            row.correct += bool(info.revision_correct)
            row.new_tokens += len(rev.completion_ids)
        else:
            ok = is_correct(services.score(g, params.reward).rewards[0])
            row.correct += ok
            row.new_tokens += len(orig.completion_ids)
    row.seconds = time.perf_counter() - t0
    return row


def full_end_row(groups: list[Group], params: ReflectParams, services: BenchServices, tok: Any) -> Row:
    """Keep every thinking token, add the forced ending, let the policy complete (0 % removed)."""
    from reflect_svc.chunking import chunk_thinking
    from reflect_svc.revise import build_revision, is_correct

    row = Row("full+end")
    t0 = time.perf_counter()
    forced = tok.encode(params.forced_ending, add_special_tokens=False)
    dec = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    for g in groups:
        orig = g.trajectories[0]
        th = chunk_thinking(orig.completion_ids, dec)
        req = RolloutRequest(
            group_id=f"{g.id}.full",
            prompt_ids=orig.prompt_ids + orig.completion_ids[: th.end] + forced,
            sampling={"max_tokens": params.max_tokens, "temperature": 0.0},  # type: ignore[arg-type]
        )
        gen = services.complete([req])[0].trajectories[0]
        rev = build_revision(orig, th.end, forced, gen, None, {})
        rev.text = tok.decode(rev.completion_ids, skip_special_tokens=True)
        ok = is_correct(
            services.score(g.model_copy(update={"trajectories": [rev]}), params.reward).rewards[0]
        )
        row.n += 1
        row.think += th.n_tokens
        row.truncated += 1
        row.correct += ok
        row.rev_correct += ok
        row.orig_tokens += len(orig.completion_ids)
        row.new_tokens += len(rev.completion_ids)
    row.seconds = time.perf_counter() - t0
    return row


def table(rows: list[Row]) -> None:
    print(f"{'method':<16}{'truncated':>10}{'think removed':>15}{'acc':>8}{'rev acc':>9}{'TR %':>8}{'s':>7}")
    for r in rows:
        removed = 100.0 * r.removed / max(r.think, 1)
        acc = 100.0 * r.correct / max(r.n, 1)
        rev_acc = 100.0 * r.rev_correct / r.truncated if r.truncated else float("nan")
        tr = 100.0 * r.new_tokens / max(r.orig_tokens, 1)
        print(
            f"{r.name:<16}{r.truncated:>6}/{r.n:<3}{removed:>14.1f}%{acc:>7.1f}%{rev_acc:>8.1f}%{tr:>8.1f}{r.seconds:>7.1f}"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="problems per kind (arith, countdown)")
    ap.add_argument("--min-chunk-tokens", type=int, nargs="+", default=[32, 8])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--checks", type=int, nargs=2, default=[1, 5], help="re-checks per trace (inclusive)")
    args = ap.parse_args(argv)
    configure_process()
    from reward_svc.pool import VerifierPool
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR)
    tok = engine.tokenizer
    groups = corpus(tok, args.n, (args.checks[0], args.checks[1]))
    print(
        f"corpus: {len(groups)} reflective traces (arith + countdown,"
        f" {args.checks[0]}-{args.checks[1]} re-checks), tiny model completes revisions"
    )
    print("engine: torch, in-process (rollout_svc core), greedy; scoring: reward_svc core + verifier pool")
    with VerifierPool(1) as pool:
        services = BenchServices(engine, pool)
        for min_tokens in args.min_chunk_tokens:
            base = ReflectParams(min_chunk_tokens=min_tokens, max_tokens=args.max_tokens, temperature=0.0)
            orig = Row("original", n=len(groups), correct=0)
            for g in groups:
                t = g.trajectories[0]
                orig.orig_tokens += len(t.completion_ids)
                orig.new_tokens += len(t.completion_ids)
                orig.correct += is_ok(services, g, base)
            gold = run_method("gold", groups, base.model_copy(update={"detector": "gold"}), services, tok)
            ratio = gold.removed / max(gold.think, 1)
            rows = [
                orig,
                full_end_row(groups, base, services, tok),
                gold,
                run_method(
                    "heuristic k=1",
                    groups,
                    base.model_copy(update={"detector": "heuristic", "keyword_k": 1}),
                    services,
                    tok,
                ),
                run_method(
                    "heuristic k=5",
                    groups,
                    base.model_copy(update={"detector": "heuristic", "keyword_k": 5}),
                    services,
                    tok,
                ),
                run_method(
                    f"fixed {100 * (1 - ratio):.0f}%",
                    groups,
                    base.model_copy(update={"detector": "fixed", "fixed_keep": max(1e-3, 1.0 - ratio)}),
                    services,
                    tok,
                ),
            ]
            print(
                f"\nmin_chunk_tokens={min_tokens} max_chunk_tokens={base.max_chunk_tokens}"
                " (TR: tokens vs original)"
            )
            table(rows)


def is_ok(services: BenchServices, g: Group, params: ReflectParams) -> bool:
    from reflect_svc.revise import is_correct

    return is_correct(services.score(g, params.reward).rewards[0])


if __name__ == "__main__":
    main()
