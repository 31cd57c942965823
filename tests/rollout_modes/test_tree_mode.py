"""tree mode on Loom's tiny model in the real torch engine: tree structure, parents and spans, every
strategy, expansion through the reward callback, token-exact branches, TreeRL advantages from the group."""

from __future__ import annotations

from asyncio import run

import pytest

from learner.estimators import treerl
from loom.contracts.modes import parse_mode_params
from loom.contracts.wire import RolloutRequest, SamplingParams
from rollout_svc.engines.base import UnsupportedCapability
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.engines.vllm import VLLMEngine
from rollout_svc.modes import MODES, ModeError
from rollout_svc.modes.scorers import exact_reward_fn
from rollout_svc.modes.tree import tree
from zoo.tiny import make_problems, reflect_prompt

PROBLEM = make_problems("arith", 1, seed=1)[0]


def _request(**mode_params) -> RolloutRequest:
    base = {"initial": 3, "delta": 2, "min_distance": 4}
    return RolloutRequest(
        mode="tree",
        prompt=reflect_prompt(PROBLEM),
        sampling=SamplingParams(max_tokens=120, seed=5),
        task="arithmetic",
        label=PROBLEM.gold,
        mode_params={**base, **mode_params},
    )


def _grow(engine, request, reward_fn=None):
    ids = engine.tokenizer.encode(request.prompt, add_special_tokens=False)
    return run(tree(request, ids, "g", engine, engine.tokenizer, parse_mode_params(request), reward_fn))


@pytest.mark.parametrize("strategy", ["attention", "entropy", "random"])
def test_tree_structure_parents_and_spans(tiny_engine, strategy):
    group = _grow(tiny_engine, _request(strategy=strategy))
    assert group.mode == "tree" and group.tree
    by_traj = {t.id: t for t in group.trajectories}
    nodes = {n.id: n for n in group.tree}
    points = group.meta["branch_points"]
    n_branches = sum(len(p) for p in points.values())
    assert n_branches > 0, f"{strategy} found no branch point"
    assert len(group.trajectories) == 3 + 2 * n_branches == group.meta["n_leaves"]
    for node in group.tree:
        owner = by_traj[node.trajectory_id]
        assert 0 <= node.start < node.end <= len(owner.completion_ids)
        if node.parent is not None:
            assert nodes[node.parent].end == node.start  # a child starts where its parent ends
    for t in group.trajectories:
        if t.parent_id is None:  # an initial response: a chain of nodes covering it exactly
            chain = [n for n in group.tree if n.trajectory_id == t.id]
            assert chain[0].start == 0 and chain[-1].end == len(t.completion_ids)
            cuts = [n.start for n in chain[1:]]
            assert cuts == points.get(t.id, [])
            continue
        parent = by_traj[t.parent_id]
        b = t.meta["branch_point"]
        assert t.completion_ids[:b] == parent.completion_ids[:b]  # prompt + response[:b] continued
        assert t.logprobs[:b] == parent.logprobs[:b]
        (own,) = [n for n in group.tree if n.trajectory_id == t.id]
        assert (own.start, own.end) == (b, len(t.completion_ids))
        assert nodes[own.parent].trajectory_id == parent.id and nodes[own.parent].end == b
        assert [s.kind for s in t.segments] == ["tree_node"] * len(t.segments)
        assert t.segments[-1].meta["node"] == own.id
        if strategy == "attention":  # the FCI of the parent's step this branch starts: one that chose it
            assert t.meta["branch_fci"] > 0.0
            assert t.meta["branch_fci"] in group.meta["fci"][parent.id]
        else:
            assert "branch_fci" not in t.meta
    assert group.meta["tokens_generated"] < group.meta["tokens_independent"]


def test_branches_are_token_exact_continuations(tiny_engine):
    group = _grow(tiny_engine, _request(strategy="random"))
    prompt = group.trajectories[0].prompt_ids
    branch = next(t for t in group.trajectories if t.parent_id is not None)
    want = teacher_forced_logprobs(tiny_engine.model, prompt + branch.completion_ids, len(prompt))
    assert branch.logprobs == pytest.approx(want, abs=1e-4)


def test_node_advantages_from_the_group(tiny_engine):
    group = _grow(tiny_engine, _request(strategy="entropy"))
    leaves = {t.id: float(i % 2) for i, t in enumerate(group.trajectories)}
    adv = treerl(group.tree, leaves)
    assert set(adv) == {n.id for n in group.tree}
    root_of = next(n for n in group.tree if n.parent is None and n.trajectory_id == group.trajectories[0].id)
    under = [
        t for t in group.trajectories if t.id == root_of.trajectory_id or t.parent_id == root_of.trajectory_id
    ]
    v_root = sum(leaves.values()) / len(leaves)
    v = sum(leaves[t.id] for t in under) / len(under)
    assert adv[root_of.id] == pytest.approx(2 * (v - v_root) / len(under) ** 0.5)


def test_reward_callback_drives_expansion_and_filtering(tiny_engine):
    all_right = _grow(
        tiny_engine, _request(strategy="random", initial=6, continuations=1), lambda ts: [1.0] * len(ts)
    )
    assert all_right.meta["accuracy"] == 1.0 and all_right.meta["expanded"] == 2  # round(exp(-1) * 6)
    assert len(all_right.meta["branch_points"]) == 2
    filtered = _grow(
        tiny_engine,
        _request(strategy="attention", initial=2, fci_running_mean=1e9),
        lambda ts: [1.0] * len(ts),
    )
    assert filtered.meta["filtered"] and filtered.meta["expanded"] == 0 and len(filtered.trajectories) == 2
    assert filtered.meta["mean_fci"] is not None


def test_exact_reward_fn_checks_the_boxed_answer(tiny_engine):
    from loom.contracts.wire import Trajectory

    fn = exact_reward_fn(_request(), tiny_engine.tokenizer)
    enc = tiny_engine.tokenizer.encode
    good = Trajectory(id="a", group_id="g", completion_ids=enc(f"</think> \\boxed{{{PROBLEM.gold}}}"))
    bad = Trajectory(id="b", group_id="g", completion_ids=enc("</think> \\boxed{1}"))
    assert fn([good, bad]) == [1.0, 0.0]
    assert exact_reward_fn(RolloutRequest(prompt="x", task="math", label="1"), tiny_engine.tokenizer) is None


def test_attention_on_an_engine_without_the_capability_is_a_typed_error(tiny_engine):
    engine = VLLMEngine("http://127.0.0.1:9")  # refused before any request is sent
    with pytest.raises(UnsupportedCapability, match="attention_scores.*LOOM_ATTENTION_URL"):
        run(tree(_request(), [1, 2], "g", engine, tiny_engine.tokenizer, parse_mode_params(_request())))


def test_bad_mode_params_are_mode_errors():
    with pytest.raises(ModeError, match="strategy"):
        parse_mode_params(_request(strategy="greedy"))
    with pytest.raises(ModeError, match="does not know"):
        parse_mode_params(_request(branchez=2))
    assert set(MODES) == {"plain", "streaming", "tree", "spawn", "agent", "agent_tree"}


@pytest.mark.parametrize("strategy", ["attention", "entropy", "random"])
def test_later_iterations_branch_the_tree_again(tiny_engine, strategy):
    """iterations=2 (TreeRL's EPTree rounds): round 2 branches each tree again, at points after a
    path's own branch point; the tree's nodes still chain exactly, and every path is token-exact."""
    group = _grow(tiny_engine, _request(strategy=strategy, iterations=2))
    by_traj = {t.id: t for t in group.trajectories}
    nodes = {n.id: n for n in group.tree}
    points = group.meta["branch_points"]
    assert group.meta["iterations"] == 2
    rounds = {t.meta.get("iteration") for t in group.trajectories if t.parent_id is not None}
    assert rounds == {1, 2}, f"{strategy}: no second round"
    n_points = sum(len(p) for p in points.values())
    assert len(group.trajectories) == 3 + 2 * n_points
    generated = 0
    for t in group.trajectories:
        start = t.meta.get("branch_point", 0)
        generated += len(t.completion_ids) - start
        chain = [n for n in group.tree if n.trajectory_id == t.id]
        assert [n.start for n in chain] == [start, *points.get(t.id, [])]
        assert chain[-1].end == len(t.completion_ids)
        assert all(start < b < len(t.completion_ids) for b in points.get(t.id, []))
        for a, b in zip(chain, chain[1:], strict=False):
            assert b.parent == a.id and a.end == b.start
        if t.parent_id is None:
            assert chain[0].parent is None
            continue
        parent = by_traj[t.parent_id]
        assert t.completion_ids[:start] == parent.completion_ids[:start]
        assert t.logprobs[:start] == parent.logprobs[:start]
        assert t.loss_mask == [1] * len(t.completion_ids)
        hung = nodes[chain[0].parent]
        assert hung.trajectory_id == parent.id and hung.end == start
        assert [s.meta["node"] for s in t.segments][-1] == chain[-1].id
    assert group.meta["tokens_generated"] == generated < group.meta["tokens_independent"]
    deep = next(t for t in group.trajectories if t.meta.get("iteration") == 2)
    prompt = deep.prompt_ids
    want = teacher_forced_logprobs(tiny_engine.model, prompt + deep.completion_ids, len(prompt))
    assert deep.logprobs == pytest.approx(want, abs=1e-4)
    adv = treerl(group.tree, {t.id: float(i % 2) for i, t in enumerate(group.trajectories)})
    assert set(adv) == set(nodes)


def test_iterations_is_validated():
    with pytest.raises(ModeError, match="iterations"):
        parse_mode_params(_request(iterations=0))
