"""APR's comparison (issue 29; APR Fig. 6): accuracy against the tokens on the critical path, spawn/join
against serial search, on the search model (zoo/search), side by side in one run.

Workload: held-out Countdown search problems (``zoo.search.search_problems``, the model's own
distribution), greedy decoding on the in-process torch engine.
  serial   the plain format (one search written out move by move), ``max_tokens`` = L for each L in
           ``--serial-budgets``: every token is on the critical path (sequential = total). Greedy, so
           each problem is generated once at the largest L and read at each smaller L from its first
           L tokens.
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
of ``zoo.search.traces.spawn_trace``, so one stage's errors do not reach the next): the parent's spawn
block exactly as in the trace; each child's returned message (a child whose pair leads to a solution
must return it, the others ``No solution``); the parent's boxed answer read off the gold join block.

Then the same problems' gold traces (``gold_paths``): the tokens a model that wrote them exactly would
put on each path, serial (the plain trace) against spawn (the parent's tokens plus its longest child's),
and spawn with every ``<Start Sub Search ...>`` line's syntax counted as one token, then such a model's
accuracy under a budget on the path. ``--gold-only`` prints these tables alone (no model is run);
``--gold-only --numbers 4`` the same for four-number Countdown (zoo/search/deep.py; spawn by pair and
by first move), which no shipped model writes yet.

``--numbers 4`` runs all of this on four-number problems (zoo/search/deep.py) for a model trained by
``loom train-deep`` (``--model DIR``), spawn mode allowed 32 children; the stage-by-stage check is left
out there (some 580 children one by one) and replaced by the same stages read off the spawn runs at
the last child budget (the spawn block, then, where it is exact, each child's message against the gold
trace by first move), with the parent's answer from the gold join block; ``--record`` writes
docs/benchmarks/apr-deep.md.

Usage: ``python bench/apr.py [--problems 40] [--serial-budgets 32,48,64,96,128,192,256,400]
[--child-budgets 16,24,32,48,96]`` (or ``loom bench apr``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
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
    p.add_argument(
        "--numbers",
        type=int,
        default=3,
        choices=(3, 4),
        help="Countdown with 3 or 4 numbers (4: --record writes apr-deep.md)",
    )
    p.add_argument("--skip", type=int, default=0, help="skip this many held-out problems first")
    p.add_argument("--json", type=Path, default=None, help="write every row's per-problem results here")
    a = p.parse_args()
    configure_process()
    if a.gold_only:
        from transformers import AutoTokenizer

        from zoo.registry import resolve_model_path
        from zoo.search import search_problems
        from zoo.tiny import HELDOUT_SEED

        tok = AutoTokenizer.from_pretrained(resolve_model_path(a.model))
        if a.numbers == 3:
            gold_paths(tok, search_problems("countdown", a.problems, HELDOUT_SEED, "test"))
        else:
            from zoo.search.deep import deep_problems

            gold_paths(tok, deep_problems(a.problems, HELDOUT_SEED, "test"), numbers=4)
        return
    from loom.answers import last_boxed
    from loom.contracts.modes import parse_mode_params
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.modes.spawn import spawn
    from zoo.registry import resolve_model_path
    from zoo.search import search_problems
    from zoo.tiny import HELDOUT_SEED, plain_prompt, spawn_prompt

    engine = TorchEngine(resolve_model_path(a.model), cache_entries=256)
    tok = engine.tokenizer
    if a.numbers == 3:
        problems = search_problems("countdown", a.skip + a.problems, HELDOUT_SEED, "test")
    else:
        from zoo.search.deep import deep_problems

        problems = deep_problems(a.skip + a.problems, HELDOUT_SEED, "test")
    problems = problems[a.skip :]
    greedy = SamplingParams(temperature=0.0, n=1, max_tokens=512 if a.numbers == 3 else 1400)

    # greedy decoding: the completion under budget L is the first L tokens of the one under the
    # largest budget, so each problem is generated once
    budgets = [int(x) for x in a.serial_budgets.split(",")]
    longest = []
    for prob in problems:
        ids = tok.encode(plain_prompt(prob), add_special_tokens=False)
        (out,) = asyncio.run(engine.generate(ids, greedy.model_copy(update={"max_tokens": max(budgets)})))
        longest.append(list(out.token_ids))
    rows: list[Row] = []
    for budget in budgets:
        row = Row(f"serial L={budget}")
        for prob, out_ids in zip(problems, longest, strict=True):
            text = tok.decode(out_ids[:budget])
            row.correct.append(prob.verify(last_boxed(text) if "</think>" in text else None))
            row.sequential.append(min(budget, len(out_ids)))
            row.total.append(min(budget, len(out_ids)))
        rows.append(row)
        print(f"{row.name:16s} accuracy {row.accuracy:.3f}  sequential {row.seq:6.1f}  total {row.tot:6.1f}")

    spawn_rows: list[Row] = []
    runs: list[tuple[str, list[str]]] = []  # per problem at the last child budget: root text, messages
    for child in [int(x) for x in a.child_budgets.split(",")]:
        row = Row(f"spawn C={child}")
        runs = []
        for prob in problems:
            req = RolloutRequest(
                mode="spawn",
                prompt=spawn_prompt(prob),
                sampling=greedy,
                mode_params={"child_max_tokens": child}
                if a.numbers == 3
                else {"child_max_tokens": child, "max_children": 32, "max_total_tokens": 32 * child + 1024},
            )
            ids = tok.encode(req.prompt, add_special_tokens=False)
            group = asyncio.run(spawn(req, ids, "apr", engine, tok, parse_mode_params(req)))
            root = next(t for t in group.trajectories if t.meta.get("depth") == 0)
            text = tok.decode(root.completion_ids)
            runs.append((text, [link.message for link in group.threads or [] if link.parent == root.id]))
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
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        facts = {
            "model": a.model,
            "numbers": a.numbers,
            "skip": a.skip,
            "problems": [q.text for q in problems],
        }
        a.json.write_text(json.dumps({**facts, "rows": [asdict(r) for r in [*rows, *spawn_rows]]}, indent=1))
    if a.numbers == 3:
        table += ["", *stages(engine, tok, problems)]
    else:  # four numbers: some 580 children one by one would be too slow here; read off the spawn runs
        table += ["", *deep_stages(engine, tok, problems, runs)]
    table += ["", *gold_paths(tok, problems, a.numbers)]
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
            "apr" if a.numbers == 3 else "apr-deep",
            f"APR: spawn/join vs serial search ({a.model} model, {len(problems)} problems)",
            table,
            plot=plot,
        )
        print(f"recorded in {path}")


def stages(engine, tok, problems) -> list[str]:  # type: ignore[no-untyped-def]
    """Each stage of spawn/join on its gold input: a table (markdown lines), also printed."""
    from loom.answers import last_boxed
    from zoo.search.traces import spawn_trace

    head = found = solving = declined = unsolving = answer = 0
    for prob in problems:
        gold = spawn_trace(prob)
        head += (
            greedy_text(engine, tok, gold.parent[0].text, 160).strip().startswith(gold.parent[1].text.strip())
        )
        for child, message in zip(gold.children, gold.messages, strict=True):
            returned = greedy_text(engine, tok, child[0].text, 200).split("</think>")[-1].strip()
            if message == "No solution":
                unsolving += 1
                declined += returned == message
            else:
                solving += 1
                found += returned == message
        context = "".join(piece.text for piece in gold.parent[:3])
        answer += prob.verify(last_boxed(greedy_text(engine, tok, context, 40)))
    n = len(problems)
    rows = [
        ("spawn block exactly as the trace's", head, n),
        ("a child whose pair solves returns the solution", found, solving),
        ("a child whose pair does not solve returns `No solution`", declined, unsolving),
        ("the parent's answer from the gold join block is correct", answer, n),
    ]
    return stage_table("spawn/join stage, on its gold input (greedy)", "each on its gold input", rows)


def greedy_text(engine, tok, text: str, max_tokens: int) -> str:  # type: ignore[no-untyped-def]
    """The engine's greedy completion of ``text`` (at most ``max_tokens``), decoded."""
    ids = tok.encode(text, add_special_tokens=False)
    (out,) = asyncio.run(engine.generate(ids, SamplingParams(temperature=0.0, n=1, max_tokens=max_tokens)))
    return str(tok.decode(out.token_ids, skip_special_tokens=True))


def stage_table(head: str, printed: str, rows: list[tuple[str, int, int]]) -> list[str]:
    """``rows`` (stage, correct, of) as markdown lines under ``head``; also printed after ``printed``."""
    print(f"\nstage by stage, {printed}:")
    for name, k, m in rows:
        print(f"  {name:58s} {k:3d}/{m:3d} = {k / max(1, m):.3f}")
    return [
        f"| {head} | correct | of | rate |",
        "|---|---|---|---|",
        *(f"| {name.strip()} | {k} | {m} | {k / max(1, m):.3f} |" for name, k, m in rows),
    ]


def returned_expression(message: str) -> str | None:
    """A four-number child's returned steps (``7+4=11 5*4=20 20+11=31``) as the expression they build,
    None where they are no such steps or one is false arithmetic (``20+11=30``)."""
    from zoo.tiny.tasks import _apply
    from zoo.tiny.traces import _STEP, expression_from_steps

    steps = message.split()
    parts = [_STEP.match(step) for step in steps]
    if not steps or any(m is None or _apply(int(m[1]), m[2], int(m[3])) != int(m[4]) for m in parts):
        return None
    return expression_from_steps(steps)


def deep_stages(engine, tok, problems, runs) -> list[str]:  # type: ignore[no-untyped-def]
    """Four numbers: the stages read off the spawn runs at the last child budget (``runs``: per
    problem the root's text and its children's returned messages) against the gold trace by first
    move (zoo.search.deep.spawn_trace), the run's own answer where some child returned a true
    solution (a false one before it is the parent's to pass over), and the parent's answer from the
    gold join block (one greedy call each): a table (markdown lines), also printed."""
    from loom.answers import last_boxed
    from loom.formats import DEFAULT_SPAWN
    from rollout_svc.engines.base import InvalidPrompt
    from zoo.search.deep import spawn_trace

    block = solving = found = unsolving = declined = joined = answer = full = returned = answered = 0
    for prob, (text, messages) in zip(problems, runs, strict=True):
        gold = spawn_trace(prob, by="move")
        if any(prob.verify(returned_expression(m)) for m in messages):  # `No solution` is None
            returned += 1
            answered += prob.verify(last_boxed(text) if "</think>" in text else None)
        if text.strip().startswith(gold.parent[1].text.strip()):  # children's messages comparable
            block += 1
            for got, want in zip(messages, gold.messages, strict=False):
                if want == DEFAULT_SPAWN.no_solution:
                    unsolving += 1
                    declined += got == want
                else:
                    solving += 1
                    found += got == want
            first = next((m for m in messages if m != DEFAULT_SPAWN.no_solution), None)
            joined += first is not None and first in gold.messages
        context = "".join(piece.text for piece in gold.parent[:3])
        try:
            answer += prob.verify(last_boxed(greedy_text(engine, tok, context, 120)))
        except InvalidPrompt:  # the gold join block alone fills the model's window: no answer
            full += 1
    n = len(problems)
    rows = [
        ("spawn block exactly as the trace's (by first move)", block, n),
        ("  a child whose move solves returns the gold solution", found, solving),
        ("  a child whose move does not solve returns `No solution`", declined, unsolving),
        ("  the first solution returned is a gold one", joined, block),
        ("the parent's answer where a child returned a true solution", answered, returned),
        ("the parent's answer from the gold join block is correct", answer, n),
        ("  the gold join block leaves the parent no room to answer", full, n),
    ]
    head = "spawn/join stage (four numbers, greedy)"
    return stage_table(head, "the spawn runs above, the answer on the gold join block", rows)


@dataclass
class GoldPaths:
    """Per problem, the trained tokens of a gold trace's paths."""

    serial: list[int] = field(default_factory=list)  # the plain trace's completion
    positions: list[int] = field(default_factory=list)  # the plain trace's prompt + completion
    parent: list[int] = field(default_factory=list)  # the spawn parent's own tokens (spawn block, answer)
    longest: list[int] = field(default_factory=list)  # the longest child's
    solving: list[int] = field(default_factory=list)  # the shortest child that returns a solution
    children: list[int] = field(default_factory=list)


def measure_gold(tok, problems, plain, spawn) -> GoldPaths:  # type: ignore[no-untyped-def]
    """``plain(problem)`` -> pieces, ``spawn(problem)`` -> SpawnTrace: the tokens on each path."""
    from loom.formats import DEFAULT_SPAWN

    def n(pieces, trained_only: bool = True) -> int:  # type: ignore[no-untyped-def]
        return sum(
            len(tok.encode(p.text, add_special_tokens=False)) for p in pieces if p.train or not trained_only
        )

    g = GoldPaths()
    for prob in problems:
        trace = plain(prob)
        g.serial.append(n(trace))
        g.positions.append(n(trace, trained_only=False))
        gold = spawn(prob)
        lengths = [n(c) for c in gold.children]
        g.parent.append(n(gold.parent))
        g.longest.append(max(lengths))
        g.solving.append(
            min(k for k, m in zip(lengths, gold.messages, strict=True) if m != DEFAULT_SPAWN.no_solution)
        )
        g.children.append(len(lengths))
    return g


def gold_paths(tok, problems, numbers: int = 3) -> list[str]:  # type: ignore[no-untyped-def]
    """Path lengths of the gold traces (what a model writing them exactly would generate): a table
    (markdown lines), also printed. ``numbers`` 3: zoo.search.traces (the search model's); 4:
    zoo.search.deep, spawn by pair and by first move, with the accuracy of such a model under a
    budget on the path."""
    from loom.formats import DEFAULT_SPAWN

    syntax = len(tok.encode(DEFAULT_SPAWN.spawn_child.format(i=0, node=0), add_special_tokens=False))
    if numbers == 3:
        from zoo.search.traces import plain_trace, spawn_trace

        spawns = {"": measure_gold(tok, problems, plain_trace, spawn_trace)}
    else:
        from zoo.search import deep

        spawns = {
            f" ({by})": measure_gold(
                tok, problems, deep.plain_trace, lambda p, by=by: deep.spawn_trace(p, by=by)
            )
            for by in ("pair", "move")
        }
    first = next(iter(spawns.values()))
    rows: list[tuple[str, list[int]]] = [("serial search (the plain trace)", first.serial)]
    if numbers != 3:
        rows.append(("serial search: positions (prompt + trace)", first.positions))
    for by, g in spawns.items():
        critical = [a + b for a, b in zip(g.parent, g.longest, strict=True)]
        rows += [
            (f"spawn{by}: children", g.children),
            (f"spawn{by}: the parent's tokens", g.parent),
            (f"spawn{by}: the longest child's tokens", g.longest),
            (f"spawn{by}: critical path (parent + longest child)", critical),
            (
                f"spawn{by}: critical path, each child's {syntax}-token spawn syntax as 1 token",
                [c - (syntax - 1) * k for c, k in zip(critical, g.children, strict=True)],
            ),
        ]
    if numbers == 3:
        rows = [r for r in rows if not r[0].endswith("children")]
    lines = [
        f"| gold traces ({len(problems)} problems, {numbers} numbers): tokens on the path"
        " | mean | min | max |",
        "|---|---|---|---|",
        *(f"| {name} | {statistics.fmean(v):.1f} | {min(v)} | {max(v)} |" for name, v in rows),
    ]
    print(f"\ngold traces ({numbers} numbers), tokens on the path:")
    for name, v in rows:
        print(f"  {name:72s} mean {statistics.fmean(v):6.1f}  min {min(v):4d}  max {max(v):4d}")
    return lines + ["", *gold_budgets(first.serial, spawns)]


def gold_budgets(serial: list[int], spawns: dict[str, GoldPaths]) -> list[str]:
    """Accuracy of a model writing the gold traces exactly under a budget L on the path, and the mean
    tokens it then puts on the path: serial search solves a problem when its trace fits in L (path
    min(L, trace)); spawn/join when its parent's tokens plus its shortest solving child's fit, the
    children cut at L minus the parent's tokens (path min(L, parent + longest child))."""
    top = max(
        max(serial), *(max(p + s for p, s in zip(g.parent, g.solving, strict=True)) for g in spawns.values())
    )
    budgets = sorted({b for b in (64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048) if b < top} | {top})
    head = ["budget L on the path", "serial", *(f"spawn{by}" for by in spawns)]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    print("\naccuracy (mean tokens on the path) of a gold-writing model under a budget on the path:")
    for b in budgets:
        cells = [(statistics.fmean(s <= b for s in serial), statistics.fmean(min(b, s) for s in serial))]
        for g in spawns.values():
            solved = statistics.fmean(p + s <= b for p, s in zip(g.parent, g.solving, strict=True))
            path = statistics.fmean(min(b, p + k) for p, k in zip(g.parent, g.longest, strict=True))
            cells.append((solved, path))
        lines.append(f"| {b} | " + " | ".join(f"{a:.3f} ({t:.0f})" for a, t in cells) + " |")
        print(
            f"  L {b:5d}  "
            + "  ".join(f"{h} {a:.3f} ({t:.0f})" for h, (a, t) in zip(head[1:], cells, strict=True))
        )
    return lines


if __name__ == "__main__":
    main()
