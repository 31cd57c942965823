"""Four-number Countdown traces (loom/search/deep.py): the two-level search is complete and exact, the
spawn traces (by pair, by first move) return the right solutions, parse with the tiny model's parsers,
and bench/apr.py's gold table for four numbers counts what the traces hold."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from loom.answers import last_boxed
from loom.exact import check_countdown
from loom.formats import DEFAULT_SPAWN
from loom.search.deep import (
    deep_moves,
    deep_problems,
    deep_search,
    plain_trace,
    solving_first_moves,
    spawn_trace,
)
from loom.tiny import HELDOUT_SEED, is_held_out, parse_spawn
from loom.tiny.traces import join_block, trace_text

PROBLEMS = deep_problems(30, seed=3, split="train")


def test_first_moves_cover_every_pair_once_and_leave_three_numbers():
    got = {(m.x, m.op, m.y, m.r, m.rest) for m in deep_moves((2, 3, 5, 8))}
    assert (8, "*", 3, 24, (24, 5, 2)) in got
    assert (5, "-", 2, 3, (8, 3, 3)) in got
    assert not any(m.op == "/" and m.x % m.y for m in deep_moves((2, 3, 5, 8)))
    assert {(m.x, m.y) for m in deep_moves((2, 3, 5, 8))} == {(3, 2), (5, 2), (8, 2), (5, 3), (8, 3), (8, 5)}
    assert len(deep_moves((4, 4, 4, 4))) == 4  # one pair value, + - * / once each
    # in the order of the pool larger first, whatever order the problem gives
    pairs = [(m.x, m.y) for m in deep_moves((4, 5, 7, 4))]
    assert pairs == sorted(pairs, reverse=True) and pairs == [(m.x, m.y) for m in deep_moves((7, 5, 4, 4))]


def test_the_search_is_complete_and_stops_at_the_first_solution():
    numbers, target = (2, 3, 5, 8), 24
    lines, solution = deep_search(target, deep_moves(numbers), random.Random(0))
    assert solution is not None and len(solution) == 3
    assert lines[-1].endswith(solution[-1])  # the last line says yes with the finishing step
    assert sum(line.endswith(" yes " + solution[-1]) for line in lines) == 1
    firsts = [line for line in lines if line.count(",") == 2]  # a first move: three numbers left
    assert firsts == [line for line in lines if line.startswith("> ")]  # marked, and only they
    assert firsts[-1].startswith("> " + solution[0])
    assert deep_search(997, deep_moves(numbers), random.Random(0))[1] is None


def test_problems_keep_few_solving_first_moves_and_the_split():
    assert all(1 <= solving_first_moves(p) <= 2 for p in PROBLEMS)
    assert all(len(p.numbers) == 4 and not is_held_out(p) for p in PROBLEMS)
    held = deep_problems(5, HELDOUT_SEED, "test")
    assert all(is_held_out(p) for p in held)
    assert deep_problems(5, HELDOUT_SEED, "test") == held


@pytest.mark.parametrize("problem", PROBLEMS[:12], ids=lambda p: p.text)
def test_serial_and_spawn_traces_answer_exactly(problem):
    text = trace_text(plain_trace(problem))
    assert check_countdown(last_boxed(text) or "", list(problem.numbers), problem.target), text
    for by, n_children in (("pair", 6), ("move", len(deep_moves(problem.numbers)))):
        t = spawn_trace(problem, by=by)
        assert len(t.children) <= n_children and len(t.children) == len(t.messages)
        parent = t.parent[1].text
        parsed = parse_spawn(parent + t.parent[2].text + t.parent[3].text)
        assert parsed is not None and len(parsed) == len(t.children)
        assert [m for _, _, m in parsed] == [c[0].text.removeprefix("[child] ").strip() for c in t.children]
        assert t.parent[2].text == join_block(t.messages, DEFAULT_SPAWN)
        solved = [m for m in t.messages if m != DEFAULT_SPAWN.no_solution]
        assert 1 <= len(solved) <= 2 if by == "move" else len(solved) >= 1
        for m in solved:  # each returned solution is three steps that reach the target
            assert len(m.split()) == 3 and m.split()[-1].endswith(f"={problem.target}")
        assert check_countdown(last_boxed(t.parent[3].text) or "", list(problem.numbers), problem.target)


def test_gold_table_for_four_numbers_counts_the_traces():
    from transformers import AutoTokenizer

    from loom.models import resolve_model_path
    from tests.bench.test_rl_benches import bench

    tok = AutoTokenizer.from_pretrained(resolve_model_path("search"))
    problems = PROBLEMS[:5]
    lines = bench("apr").gold_paths(tok, problems, numbers=4)
    table = [line for line in lines if line.startswith("| ") and " | " in line]
    means = {line.split(" | ")[0].lstrip("| "): float(line.split(" | ")[1]) for line in table[1:9]}

    def n(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    serial = [n(plain_trace(p)[1].text) for p in problems]
    assert means["serial search (the plain trace)"] == round(sum(serial) / len(serial), 1)
    assert means["spawn (pair): children"] == 6.0
    # the budget table: at the largest budget every problem is solved by every method
    last = lines[-1].strip("| ").split(" | ")
    assert [float(v.split()[0]) for v in last[1:]] == [1.0, 1.0, 1.0]
    # ... and serial search's mean path there is its whole trace (the budget cuts none)
    assert abs(float(last[1].split()[1].strip("()")) - means["serial search (the plain trace)"]) <= 0.55


@pytest.mark.slow
def test_train_deep_writes_a_checkpoint_and_widens_the_positions_on_request(tmp_path):
    import json

    from loom.runtime import configure_process
    from loom.search import SEARCH_CHECKPOINT_DIR
    from loom.search.deep_train import DeepTrainConfig, build_sequences, heldout, main, model_card, train
    from loom.tiny import load_model, load_tokenizer
    from loom.tiny.evaluate import Budgets
    from loom.tiny.train import encode, fit

    configure_process()
    cfg = DeepTrainConfig(steps=2, warmup=1, train_problems=4, keep_problems=3, batch_size=2, eval_problems=2)
    card = train(cfg, SEARCH_CHECKPOINT_DIR, tmp_path / "a", evaluate_after=False)
    seqs = build_sequences(deep_problems(4, 0, "train"), [])
    assert card["max_positions"] == 1024 and card["final_loss"] > 0
    # per four-number problem its serial search, a spawn parent and one child per first move
    assert len(seqs) == sum(2 + len(deep_moves(p.numbers)) for p in deep_problems(4, 0, "train"))
    kept = build_sequences(deep_problems(4, 0, "train"), [], cfg.child_keep)
    assert card["sequences"] == len(kept) + 3 * (1 + 1 + 3)  # three-number: plain, parent, 3 children
    # children that found nothing are thinned at child_keep; those that found a solution all stay
    thin = build_sequences(deep_problems(40, 0, "train"), [], child_keep=0.25)
    full = build_sequences(deep_problems(40, 0, "train"), [])
    solving = [s for s in full if s[-1].text.split("</think>")[-1].strip() != DEFAULT_SPAWN.no_solution]
    assert len(solving) < len(thin) < len(full)
    assert all(s in thin for s in solving)
    saved = json.loads((tmp_path / "a" / "card.json").read_text())
    assert model_card(saved) == (tmp_path / "a" / "MODEL_CARD.md").read_text()
    model, tok = load_model(tmp_path / "a"), load_tokenizer(tmp_path / "a")
    assert model.config.max_position_embeddings == 1024
    # fit trains with SDPA and hands the model back with the attention it came with
    fit(model, tok, encode(seqs[:2], tok, 64), replace(cfg, steps=1), False, "one step")
    assert model.config._attn_implementation == "eager"
    assert tok.get_vocab() == load_tokenizer(SEARCH_CHECKPOINT_DIR).get_vocab()
    small = Budgets(plain=16, spawn_head=16, child=8, join_answer=8)
    got = heldout(model, tok, 2, small)
    assert set(got) == {"plain", "spawn"} and all(r.total == 2 for r in got.values())
    argv = ["--init", str(tmp_path / "a"), "--out", str(tmp_path / "b"), "--steps", "1", "--batch-size", "2"]
    argv += ["--train-problems", "2", "--keep-problems", "1", "--no-eval", "--max-len", "2048"]
    assert main(argv) == 0
    saved = json.loads((tmp_path / "b" / "card.json").read_text())
    assert saved["init"] == str(tmp_path / "a") and saved["max_positions"] == 2048
    assert load_model(tmp_path / "b").config.max_position_embeddings == 2048
