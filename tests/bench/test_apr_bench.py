"""bench/apr.py's gold-trace path lengths (issue 38): what a model writing the search traces exactly
would put on serial search's path and on spawn/join's critical path."""

from __future__ import annotations

from loom.models import resolve_model_path
from loom.search import search_problems
from loom.search.traces import plain_trace, spawn_trace
from loom.tiny import HELDOUT_SEED
from tests.bench.test_rl_benches import bench


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
