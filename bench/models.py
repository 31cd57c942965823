"""The two built-in models side by side (issue 29): held-out greedy accuracy per format of the tiny
model (zoo/tiny) and the search model (zoo/search), each on both held-out sets:

  tiny set    ``tiny_problems(kind, n, HELDOUT_SEED, "test")``: arithmetic and three-number Countdown
              as the tiny model was trained on (plain/reflect/stream: both kinds; spawn: Countdown);
  search set  ``search_problems("countdown", n, HELDOUT_SEED, "test")``: Countdown with at most two
              solving first moves, the search model's distribution (every format).

Greedy limits: the search model's (zoo.search.train.BUDGETS) for both models on both sets, so neither
is cut short. Also printed: mean lines of thinking of correct plain answers (the steps a tree can
branch at) per model on the search set.

Usage: ``python bench/models.py [--problems 40]`` (or ``loom bench models``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loom.runtime import configure_process  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--problems", type=int, default=40, help="held-out problems per format and kind")
    p.add_argument("--record", action="store_true", help="write docs/benchmarks/models.md and models.png")
    a = p.parse_args()
    configure_process()
    from loom.answers import last_boxed
    from zoo.registry import resolve_model_path
    from zoo.search.train import BUDGETS, eval_sets
    from zoo.tiny import HELDOUT_SEED, load_model, load_tokenizer, plain_prompt, tiny_problems
    from zoo.tiny.evaluate import evaluate, generate_batch
    from zoo.tiny.model import n_params
    from zoo.tiny.train import MIX

    tiny_set = {
        fmt: [q for kind in kinds for q in tiny_problems(kind, a.problems, HELDOUT_SEED, "test")]  # type: ignore[arg-type]
        for fmt, kinds in MIX.items()
    }
    search_set = eval_sets(a.problems)
    results: dict[tuple[str, str], dict] = {}
    lines: dict[str, float] = {}
    params: dict[str, int] = {}
    for name in ("tiny", "search"):
        path = resolve_model_path(name)
        model, tok = load_model(path), load_tokenizer(path)
        t0 = time.perf_counter()
        results[(name, "tiny set")] = evaluate(model, tok, tiny_set, BUDGETS)
        results[(name, "search set")] = evaluate(model, tok, search_set, BUDGETS)
        probs = search_set["plain"]
        outs = generate_batch(model, tok, [plain_prompt(q) for q in probs], [], BUDGETS.plain)
        think = [
            o.split("</think>")[0].count("\n") + 1
            for q, o in zip(probs, outs, strict=True)
            if "</think>" in o and q.verify(last_boxed(o))
        ]
        lines[name] = statistics.fmean(think) if think else 0.0
        params[name] = n_params(model)
        print(f"{name}: {n_params(model):,} parameters, evaluated in {time.perf_counter() - t0:.0f} s")
    table = ["| format | held-out set | tiny | search |", "|---|---|---|---|"]
    for which in ("tiny set", "search set"):
        for fmt in MIX:
            cells = []
            for name in ("tiny", "search"):
                r = results[(name, which)][fmt]
                cells.append(f"{r.accuracy:.3f} ({r.correct}/{r.total})")
            table.append(f"| {fmt} | {which} | {cells[0]} | {cells[1]} |")
    note = (
        f"Mean thinking lines of correct plain answers on the search set: tiny {lines['tiny']:.1f}, "
        f"search {lines['search']:.1f}."
    )
    print("\n" + "\n".join(table) + "\n\n" + note)
    if a.record:
        from bench.report import write

        def plot(fig) -> None:  # type: ignore[no-untyped-def]

            ax = fig.subplots()
            fmts = list(MIX)
            for k, (name, which) in enumerate(
                [(n, w) for w in ("tiny set", "search set") for n in ("tiny", "search")]
            ):
                xs = [i + k * 0.2 for i in range(len(fmts))]
                ax.bar(
                    xs,
                    [results[(name, which)][f].accuracy for f in fmts],
                    0.2,
                    label=f"{name} model, {which}",
                )
            ax.set_xticks([i + 0.3 for i in range(len(fmts))], fmts)
            ax.set_ylabel("held-out greedy accuracy")
            ax.legend(fontsize=8)

        sizes = ", ".join(f"{n}: {params[n]:,} parameters" for n in params)
        path = write(
            "models",
            "The built-in models: held-out greedy accuracy per format",
            table,
            [note, "", sizes],
            plot,
        )
        print(f"recorded in {path}")


if __name__ == "__main__":
    main()
