"""APR's comparison (issue 29; APR Fig. 6): accuracy against the tokens on the critical path, spawn/join
against serial search, on the search model (loom/search), side by side in one run.

Workload: held-out Countdown search problems (``loom.search.search_problems``, the model's own
distribution), greedy decoding on the in-process torch engine.
  serial   the plain format (one search written out move by move), ``max_tokens`` = L for each L in
           ``--serial-budgets``: every token is on the critical path (sequential = total).
  spawn    the spawn format through spawn mode (rollout_svc.modes.spawn): the parent spawns one child
           per pair of numbers, the children search in parallel, the parent answers after the join;
           ``child_max_tokens`` = C for each C in ``--child-budgets``. Sequential tokens = the parent's
           tokens plus the longest child's (``Group.meta["sequential_tokens"]``), total = all calls.
Printed per setting: accuracy (exact Countdown check of the boxed answer), mean sequential and mean
total tokens per problem; then, for each spawn setting, serial accuracy at the smallest serial budget
whose mean sequential tokens reach the spawn setting's ("equal latency") and at the one whose mean
total reaches the spawn setting's total ("equal total budget"); where none reaches it, the largest
(its searches all end sooner: marked ``ends sooner``). APR's direction: spawn more accurate at equal
latency.

Then where spawn loses, stage by stage on the same problems (greedy, each stage given the gold input
of ``loom.search.traces.spawn_trace``, so one stage's errors do not reach the next): the parent's spawn
block exactly as in the trace; each child's returned message (a child whose pair leads to a solution
must return it, the others ``No solution``); the parent's boxed answer read off the gold join block.

Then the same problems' gold traces (``gold_paths``): the tokens a model that wrote them exactly would
put on each path, serial (the plain trace) against spawn (the parent's tokens plus its longest child's),
and spawn with every ``<Start Sub Search ...>`` line's syntax counted as one token. ``--gold-only``
prints this table alone (no model is run).

Usage: ``python bench/apr.py [--problems 40] [--serial-budgets 32,48,64,96,128,192,256,400]
[--child-budgets 16,24,32,48,96]`` (or ``loom bench apr``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.contracts.wire import RolloutRequest, SamplingParams  # noqa: E402
from loom.runtime import configure_process  # noqa: E402


@dataclass
class Row:
    name: str
    correct: list[bool] = field(default_factory=list)
    sequential: list[int] = field(default_factory=list)
    total: list[int] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / max(1, len(self.correct))

    @property
    def seq(self) -> float:
        return statistics.fmean(self.sequential)

    @property
    def tot(self) -> float:
        return statistics.fmean(self.total)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--problems", type=int, default=40)
    p.add_argument("--serial-budgets", default="32,48,64,96,128,192,256,400")
    p.add_argument("--child-budgets", default="16,24,32,48,96")
    p.add_argument("--model", default="search", help="a built-in model name or a checkpoint directory")
    p.add_argument("--record", action="store_true", help="write docs/benchmarks/apr.md and apr.png")
    p.add_argument("--gold-only", action="store_true", help="gold traces' path lengths only")
    a = p.parse_args()
    configure_process()
    if a.gold_only:
        from transformers import AutoTokenizer

        from loom.models import resolve_model_path
        from loom.search import search_problems
        from loom.tiny import HELDOUT_SEED

        tok = AutoTokenizer.from_pretrained(resolve_model_path(a.model))
        gold_paths(tok, search_problems("countdown", a.problems, HELDOUT_SEED, "test"))
        return
    from loom.answers import last_boxed
    from loom.contracts.modes import parse_mode_params
    from loom.models import resolve_model_path
    from loom.search import search_problems
    from loom.tiny import HELDOUT_SEED, plain_prompt, spawn_prompt
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.modes.spawn import spawn

    engine = TorchEngine(resolve_model_path(a.model), cache_entries=256)
    tok = engine.tokenizer
    problems = search_problems("countdown", a.problems, HELDOUT_SEED, "test")
    greedy = SamplingParams(temperature=0.0, n=1, max_tokens=512)

    rows: list[Row] = []
    for budget in [int(x) for x in a.serial_budgets.split(",")]:
        row = Row(f"serial L={budget}")
        params = greedy.model_copy(update={"max_tokens": budget})
        for prob in problems:
            ids = tok.encode(plain_prompt(prob), add_special_tokens=False)
            (out,) = asyncio.run(engine.generate(ids, params))
            text = tok.decode(out.token_ids)
            row.correct.append(prob.verify(last_boxed(text) if "</think>" in text else None))
            row.sequential.append(len(out.token_ids))
            row.total.append(len(out.token_ids))
        rows.append(row)
        print(f"{row.name:16s} accuracy {row.accuracy:.3f}  sequential {row.seq:6.1f}  total {row.tot:6.1f}")

    spawn_rows: list[Row] = []
    for child in [int(x) for x in a.child_budgets.split(",")]:
        row = Row(f"spawn C={child}")
        for prob in problems:
            req = RolloutRequest(
                mode="spawn",
                prompt=spawn_prompt(prob),
                sampling=greedy,
                mode_params={"child_max_tokens": child},
            )
            ids = tok.encode(req.prompt, add_special_tokens=False)
            group = asyncio.run(spawn(req, ids, "apr", engine, tok, parse_mode_params(req)))
            root = next(t for t in group.trajectories if t.meta.get("depth") == 0)
            text = tok.decode(root.completion_ids)
            row.correct.append(prob.verify(last_boxed(text) if "</think>" in text else None))
            row.sequential.append(group.meta["sequential_tokens"])
            row.total.append(group.meta["total_tokens"])
        spawn_rows.append(row)
        print(f"{row.name:16s} accuracy {row.accuracy:.3f}  sequential {row.seq:6.1f}  total {row.tot:6.1f}")

    print("\nspawn vs serial (serial at the smallest budget reaching the spawn setting's mean tokens):")
    table = [
        "| setting | accuracy | sequential tokens | total tokens |",
        "|---|---|---|---|",
        *(f"| {r.name} | {r.accuracy:.3f} | {r.seq:.1f} | {r.tot:.1f} |" for r in [*rows, *spawn_rows]),
        "",
    ]
    for row in spawn_rows:
        # no serial budget reaching spawn's tokens: the serial searches have all ended sooner, so the
        # largest budget is serial search at any latency (or total) at least spawn's
        lat = next((r for r in rows if r.seq >= row.seq), rows[-1])
        tot = next((r for r in rows if r.tot >= row.tot), rows[-1])
        line = (
            f"{row.name:12s} acc {row.accuracy:.3f} at {row.seq:5.1f} sequential / {row.tot:5.1f} total | "
            f"equal latency: {lat.name} acc {lat.accuracy:.3f} ({lat.seq:5.1f} seq"
            f"{', ends sooner' if lat.seq < row.seq else ''}) -> {row.accuracy - lat.accuracy:+.3f} | "
            f"equal total: {tot.name} acc {tot.accuracy:.3f} ({tot.tot:5.1f}"
            f"{', ends sooner' if tot.tot < row.tot else ''}) -> {row.accuracy - tot.accuracy:+.3f}"
        )
        print(line)
        table.append(f"- {line.strip()}")
    table += ["", *stages(engine, tok, problems), "", *gold_paths(tok, problems)]
    if a.record:
        from bench.report import write

        def plot(fig) -> None:  # type: ignore[no-untyped-def]

            ax = fig.subplots()
            ax.plot([r.seq for r in rows], [r.accuracy for r in rows], "o-", label="serial search")
            ax.plot([r.seq for r in spawn_rows], [r.accuracy for r in spawn_rows], "s-", label="spawn/join")
            ax.set_xlabel("tokens on the critical path (mean per problem)")
            ax.set_ylabel("held-out accuracy (greedy)")
            ax.legend()

        path = write(
            "apr",
            f"APR: spawn/join vs serial search ({a.model} model, {len(problems)} problems)",
            table,
            plot=plot,
        )
        print(f"recorded in {path}")


def stages(engine, tok, problems) -> list[str]:  # type: ignore[no-untyped-def]
    """Each stage of spawn/join on its gold input: a table (markdown lines), also printed."""
    from loom.answers import last_boxed
    from loom.search.traces import spawn_trace

    def greedy(text: str, max_tokens: int) -> str:
        ids = tok.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=0.0, n=1, max_tokens=max_tokens)
        (out,) = asyncio.run(engine.generate(ids, params))
        return str(tok.decode(out.token_ids, skip_special_tokens=True))

    head = found = solving = declined = unsolving = answer = 0
    for prob in problems:
        gold = spawn_trace(prob)
        head += greedy(gold.parent[0].text, 160).strip().startswith(gold.parent[1].text.strip())
        for child, message in zip(gold.children, gold.messages, strict=True):
            returned = greedy(child[0].text, 200).split("</think>")[-1].strip()
            if message == "No solution":
                unsolving += 1
                declined += returned == message
            else:
                solving += 1
                found += returned == message
        context = "".join(piece.text for piece in gold.parent[:3])
        answer += prob.verify(last_boxed(greedy(context, 40)))
    n = len(problems)
    rows = [
        ("spawn block exactly as the trace's", head, n),
        ("a child whose pair solves returns the solution", found, solving),
        ("a child whose pair does not solve returns `No solution`", declined, unsolving),
        ("the parent's answer from the gold join block is correct", answer, n),
    ]
    lines = [
        "| spawn/join stage, on its gold input (greedy) | correct | of | rate |",
        "|---|---|---|---|",
        *(f"| {name} | {k} | {m} | {k / max(1, m):.3f} |" for name, k, m in rows),
    ]
    print("\nstage by stage, each on its gold input:")
    for name, k, m in rows:
        print(f"  {name:58s} {k:3d}/{m:3d} = {k / max(1, m):.3f}")
    return lines


def gold_paths(tok, problems) -> list[str]:  # type: ignore[no-untyped-def]
    """Path lengths of the gold traces (what a model writing them exactly would generate): a table
    (markdown lines), also printed."""
    from loom.formats import DEFAULT_SPAWN
    from loom.search.traces import plain_trace, spawn_trace

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    syntax = n(DEFAULT_SPAWN.spawn_child.format(i=0, node=0))
    serial, parent, child, critical, compact = [], [], [], [], []
    for prob in problems:
        serial.append(sum(n(p.text) for p in plain_trace(prob) if p.train))
        gold = spawn_trace(prob)
        mine = sum(n(p.text) for p in gold.parent if p.train)
        longest = max(sum(n(p.text) for p in c if p.train) for c in gold.children)
        parent.append(mine)
        child.append(longest)
        critical.append(mine + longest)
        compact.append(mine + longest - (syntax - 1) * len(gold.children))
    rows = [
        ("serial search (the plain trace)", serial),
        ("spawn: the parent's tokens", parent),
        ("spawn: the longest child's tokens", child),
        ("spawn: critical path (parent + longest child)", critical),
        (f"spawn: critical path, each child's {syntax}-token spawn syntax as 1 token", compact),
    ]
    lines = [
        f"| gold traces ({len(problems)} problems): tokens on the path | mean | min | max |",
        "|---|---|---|---|",
        *(f"| {name} | {statistics.fmean(v):.1f} | {min(v)} | {max(v)} |" for name, v in rows),
    ]
    print("\ngold traces, tokens on the path:")
    for name, v in rows:
        print(f"  {name:70s} mean {statistics.fmean(v):6.1f}  min {min(v):4d}  max {max(v):4d}")
    return lines


if __name__ == "__main__":
    main()
