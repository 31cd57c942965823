"""Four-number Countdown traces (zoo/search/deep.py): the two-level search is complete and exact, the
spawn traces (by pair, by first move) return the right solutions, parse with the tiny model's parsers,
and bench/apr.py's gold table for four numbers counts what the traces hold."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from loom.answers import last_boxed
from loom.exact import check_countdown
from loom.formats import DEFAULT_SPAWN
from zoo.search.deep import (
    answer_text,
    deep_moves,
    deep_problems,
    deep_search,
    plain_trace,
    solving_first_moves,
    spawn_trace,
    substitution_chain,
)
from zoo.tiny import HELDOUT_SEED, is_held_out, parse_spawn
from zoo.tiny.tasks import _apply
from zoo.tiny.traces import _STEP, expression_from_steps, join_block, trace_text

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


def test_first_moves_reaching_the_same_three_numbers_are_searched_once():
    got = deep_moves((9, 5, 3, 1))
    assert len({m.rest for m in got}) == len(got)
    # 9*1 and 9/1 both leave [9,5,3], as do 5*1, 5/1, 3*1, 3/1: the first of them stays
    assert [m.step for m in got if m.rest == (9, 5, 3)] == ["9*1=9"]
    assert "9/1=9" not in [m.step for m in got] and "3+1=4" in [m.step for m in got]


@pytest.mark.parametrize(
    "steps, chain",
    [
        (["7+4=11", "5*4=20", "20+11=31"], ["20+11", "(5*4)+11", "(5*4)+(7+4)"]),
        (["9-3=6", "6*5=30", "30+1=31"], ["30+1", "(6*5)+1", "((9-3)*5)+1"]),
        (["2+2=4", "4*4=16", "16-4=12"], ["16-4", "(4*4)-4", "((2+2)*4)-4"]),  # 4: a number and a result
    ],
)
def test_the_answer_is_built_one_substitution_at_a_time(steps, chain):
    assert substitution_chain(steps) == chain
    assert chain[-1] == expression_from_steps(steps)
    assert answer_text(steps) == f"{' '.join(steps)}\n{' = '.join(chain)}\n</think> \\boxed{{{chain[-1]}}}"


@pytest.mark.parametrize("problem", PROBLEMS[:12], ids=lambda p: p.text)
def test_both_traces_end_in_the_substitution_chain_of_their_solution(problem):
    serial = plain_trace(problem)[1].text
    parent = spawn_trace(problem, by="move").parent[-1].text
    for text in (serial, parent):
        steps_line, chain_line, answer = text.split("\n")[-3:]
        chain = chain_line.split(" = ")
        assert chain == substitution_chain(steps_line.split()) and answer.endswith(f"{{{chain[-1]}}}")
        assert check_countdown(chain[-1], list(problem.numbers), problem.target)
        for before, after in zip(chain, chain[1:], strict=False):  # one number replaced by a (step)
            assert len(after) > len(before) and after.count("(") == before.count("(") + 1
    # the serial search's steps are its marked first move, the sub-search's move and its last line's
    assert serial.split("\n")[-4].endswith("yes " + serial.split("\n")[-3].split()[-1])


def test_decoys_are_slips_before_the_first_solution_and_leave_the_answer():
    from zoo.search.deep_train import build_sequences, decoy

    problems = deep_problems(40, 0, "train")
    placed = 0
    for p in problems:
        t = spawn_trace(p, by="move")
        got = decoy(p, t.messages, random.Random(p.key))
        first = next(i for i, m in enumerate(t.messages) if m != DEFAULT_SPAWN.no_solution)
        if got is None:
            assert first == 0
            continue
        placed += 1
        (i,) = [k for k, (a, b) in enumerate(zip(got, t.messages, strict=True)) if a != b]
        assert i < first and t.messages[i] == DEFAULT_SPAWN.no_solution
        steps = got[i].split()
        assert len(steps) == 3 and steps[0] == deep_moves(p.numbers)[i].step
        assert not steps[-1].endswith(f"={p.target}")
        for step in steps:  # each step is true arithmetic: a slip of the search, not garbage
            x, op, y, r = _STEP.match(step).groups()  # type: ignore[union-attr]
            assert _apply(int(x), op, int(y)) == int(r)
    assert placed >= 20
    # in training a parent's join block carries it at the given rate; the trained pieces are the trace's
    with_decoys = build_sequences(problems[:10], [], decoys=1.0)
    plain = build_sequences(problems[:10], [])
    assert len(with_decoys) == len(plain)
    changed = [(a, b) for a, b in zip(with_decoys, plain, strict=True) if a != b]
    assert changed and all(a[2] != b[2] and [a[1], a[3]] == [b[1], b[3]] for a, b in changed)


def test_parent_variants_answer_from_their_own_join_block():
    """The extra parents see other true solutions, failed solving children and decoys; only their
    answer is trained, and it is the first message in their join block that reaches the target."""
    from zoo.search.deep_train import build_sequences, completions, parent_variants

    problems = deep_problems(40, 0, "train")
    differs = 0
    for p in problems:
        t = spawn_trace(p, by="move")
        for i, m in enumerate(t.messages):  # a child's true solution is one of its move's completions
            hits = [" ".join(c) for c in completions(p, i, hit=True)]
            assert (m in hits) if m != DEFAULT_SPAWN.no_solution else not hits
        for v in parent_variants(p, t, 3, random.Random(p.key)):
            assert [x.train for x in v] == [False, False, False, True]
            assert v[:2] == [t.parent[0], replace(t.parent[1], train=False)]
            lines = v[2].text.splitlines()
            messages = [line.split("> ", 1)[1] for line in lines if line.startswith("<Result")]
            assert len(messages) == len(t.messages)
            first = next(m for m in messages if m.endswith(f"={p.target}"))
            assert v[3].text == answer_text(first.split())
            assert check_countdown(last_boxed(v[3].text) or "", p.numbers, p.target)
            for m, gold in zip(messages, t.messages, strict=True):  # only the children's messages move
                assert m == gold or m == DEFAULT_SPAWN.no_solution or len(m.split()) == 3
            differs += v[3] != t.parent[3]
    assert differs >= 20  # the answer is not the trace's (nor the serial search's) for many of them
    more = build_sequences(problems[:10], [], variants=3)
    assert len(more) == len(build_sequences(problems[:10], [])) + 30


def test_gold_table_for_four_numbers_counts_the_traces():
    from transformers import AutoTokenizer

    from tests.bench.test_rl_benches import bench
    from zoo.registry import resolve_model_path

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
    from zoo.recipe import encode, fit, train
    from zoo.recipes import RECIPES, main, model_card
    from zoo.search import SEARCH_CHECKPOINT_DIR
    from zoo.search.deep_train import DeepTrainConfig, build_sequences, heldout
    from zoo.tiny import load_model, load_tokenizer
    from zoo.tiny.evaluate import Budgets

    configure_process()
    cfg = DeepTrainConfig(steps=2, warmup=1, train_problems=4, keep_problems=3, batch_size=2, eval_problems=2)
    card = train(RECIPES["deep"], cfg, tmp_path / "a", evaluate_after=False)
    seqs = build_sequences(deep_problems(4, 0, "train"), [])
    assert card["max_positions"] == 1024 and card["final_loss"] > 0
    # per four-number problem its serial search, a spawn parent and one child per first move
    assert len(seqs) == sum(2 + len(deep_moves(p.numbers)) for p in deep_problems(4, 0, "train"))
    kept = build_sequences(deep_problems(4, 0, "train"), [], cfg.child_keep, variants=cfg.parent_variants)
    assert card["sequences"] == len(kept) + 3 * (1 + 1 + 3)  # three-number: plain, parent, 3 children
    # children that found nothing are thinned at child_keep; those that found a solution all stay
    thin = build_sequences(deep_problems(40, 0, "train"), [], child_keep=0.25)
    full = build_sequences(deep_problems(40, 0, "train"), [])
    solving = [s for s in full if s[-1].text.split("</think>")[-1].strip() != DEFAULT_SPAWN.no_solution]
    assert len(solving) < len(thin) < len(full)
    assert all(s in thin for s in solving)
    saved = json.loads((tmp_path / "a" / "card.json").read_text())
    assert model_card("deep", saved) == (tmp_path / "a" / "MODEL_CARD.md").read_text()
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
    assert main("deep", argv) == 0
    saved = json.loads((tmp_path / "b" / "card.json").read_text())
    assert saved["init"] == str(tmp_path / "a") and saved["max_positions"] == 2048
    assert load_model(tmp_path / "b").config.max_position_embeddings == 2048


@pytest.mark.slow
def test_the_shipped_deep_model_answers_from_its_join_block():
    """The built-in ``deep`` model (zoo/search/deep_checkpoint) is small, loads offline, and its
    spawn parent reads the gold join block into a correct answer on held-out problems (54 of 72 in
    docs/benchmarks/apr.md; a parent that wrote its own answer got 6 to 23 of 72)."""
    import asyncio

    from loom.contracts.wire import SamplingParams
    from loom.runtime import configure_process
    from rollout_svc.engines.torch import TorchEngine
    from zoo.registry import resolve_model_path
    from zoo.tiny import load_tokenizer

    configure_process()
    path = resolve_model_path("deep")
    assert sum(f.stat().st_size for f in path.iterdir()) < 20 * 2**20
    engine = TorchEngine(path, cache_entries=8)
    tok = load_tokenizer(path)
    right = 0
    problems = deep_problems(8, HELDOUT_SEED, "test")
    for p in problems:
        assert is_held_out(p)
        gold = spawn_trace(p, by="move")
        ids = tok.encode("".join(piece.text for piece in gold.parent[:3]), add_special_tokens=False)
        (out,) = asyncio.run(engine.generate(ids, SamplingParams(temperature=0.0, n=1, max_tokens=120)))
        right += check_countdown(last_boxed(tok.decode(out.token_ids)) or "", p.numbers, p.target)
    assert right >= 4, f"{right} of {len(problems)}"
