"""bench/apr.py's gold-trace path lengths (issue 38): what a model writing the search traces exactly
would put on serial search's path and on spawn/join's critical path."""

from __future__ import annotations

from tests.bench.test_rl_benches import bench
from zoo.registry import resolve_model_path
from zoo.search import search_problems
from zoo.search.traces import plain_trace, spawn_trace
from zoo.tiny import HELDOUT_SEED


def test_gold_paths_count_the_trained_tokens_of_each_path():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("search"))
    problems = search_problems("countdown", 6, HELDOUT_SEED, "test")
    lines = bench("apr").gold_paths(tok, problems)
    means = {
        line.split(" | ")[0].lstrip("| "): float(line.split(" | ")[1]) for line in lines[2 : lines.index("")]
    }

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    serial = [n(plain_trace(p)[1].text) for p in problems]  # the completion: the search and the answer
    assert means["serial search (the plain trace)"] == round(sum(serial) / len(serial), 1)
    parent = means["spawn: the parent's tokens"]
    child = means["spawn: the longest child's tokens"]
    assert abs(means["spawn: critical path (parent + longest child)"] - (parent + child)) < 0.11
    # the parent writes its state, one spawn line per pair and the answer: its join block is inserted
    first = spawn_trace(problems[0])
    assert not first.parent[2].train and len(first.children) == 3
    compact = next(v for k, v in means.items() if "as 1 token" in k)
    assert compact < means["spawn: critical path (parent + longest child)"]


def test_deep_stages_read_the_spawn_runs_against_the_gold_trace():
    """Four numbers: a run that wrote the gold spawn block counts each child's message against the gold
    messages; a run whose spawn block differs counts none of its children; a problem whose gold join
    block fills the model's 1024 positions (held-out problem 63: 1054 tokens) counts as not answered."""
    from loom.formats import DEFAULT_SPAWN
    from rollout_svc.engines.torch import TorchEngine
    from zoo.search.deep import deep_problems
    from zoo.search.deep import spawn_trace as deep_spawn

    engine = TorchEngine(resolve_model_path("search"))
    held_out = deep_problems(64, HELDOUT_SEED, "test")
    problems = [held_out[0], held_out[1], held_out[63]]
    golds = [deep_spawn(p, by="move") for p in problems]
    runs = [("".join(piece.text for piece in g.parent[1:]), list(g.messages)) for g in golds]
    # the first problem: one solving child slips; the second and third: a spawn block off by one move line
    slipped = next(i for i, m in enumerate(runs[0][1]) if m != DEFAULT_SPAWN.no_solution)
    runs[0][1][slipped] = "7+4=11 5*4=20 20+11=30"
    wrong = runs[1][0].replace("Node #1 ", "Node #9 ", 1).replace("\\boxed{", "\\boxed{0*", 1)  # no 0 to use
    runs[1] = (wrong, runs[1][1])
    runs[2] = (runs[2][0].replace("Node #1 ", "Node #9 ", 1), runs[2][1])
    apr = bench("apr")
    lines = apr.deep_stages(engine, engine.tokenizer, problems, runs)
    cells = [line.split(" | ") for line in lines[2:]]
    counts = {c[0].lstrip("| "): [int(c[1]), int(c[2])] for c in cells}
    solving = sum(m != DEFAULT_SPAWN.no_solution for m in golds[0].messages)
    assert counts["spawn block exactly as the trace's (by first move)"] == [1, 3]
    assert counts["a child whose move solves returns the gold solution"] == [solving - 1, solving]
    unsolving = len(golds[0].messages) - solving
    assert counts["a child whose move does not solve returns `No solution`"] == [unsolving, unsolving]
    assert counts["the first solution returned is a gold one"] == [0, 1]  # the slip comes first
    # the run's own answer where a child returned a true solution: the second run boxed a wrong one
    true_first = solving - 1  # the first problem's other solving child, if any, returns a true one
    assert apr.returned_expression("7+4=11 5*4=20 20+11=31") == "(5*4)+(7+4)"
    assert apr.returned_expression("7+4=11 5*4=20 20+11=30") is None  # false arithmetic: no solution
    assert apr.returned_expression("No solution") is None
    got = counts["the parent's answer where a child returned a true solution"]
    assert got == [1 + true_first, 2 + true_first]
    assert counts["the parent's answer from the gold join block is correct"][1] == 3
    assert counts["the gold join block leaves the parent no room to answer"] == [1, 3]
