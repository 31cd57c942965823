"""agent_tree mode: trees of agent episodes on Loom's tiny model in the real torch engine, with the
inline calculator (the tiny model's traces write ``3+9+0=``, the calculator answers ``12``): leaves
are exact concatenations of policy and observation tokens sharing their parents' prefixes, the
tree's node advantages (the learner's ``treerl`` estimator and the trainers' client) are eq. 2-3 on
the leaves' rewards, observation tokens are masked in training, bad parameters are refused. The
``attention`` strategy's FCI comes from the engine's own scorer (as tree mode's tests) and, on an
engine without one, from the operator's scorer: a real ``loom engine``'s ``/v1/score/attention``
(the worker security tests' ``engine_url``). Nothing is mocked."""

from __future__ import annotations

import math
from asyncio import run
from typing import Any

import pytest
import torch

from gateway.cost import per_sample
from learner.assign import assign_batch
from learner.config import LearnerSettings
from learner.train import Learner
from loom.clients.rollouts import env_mask, tree_advantages
from loom.contracts.modes import AgentTreeParams, parse_mode_params
from loom.contracts.settings import Settings
from loom.contracts.wire import (
    Group,
    LossSpec,
    RewardResult,
    RolloutRequest,
    SamplingParams,
    TrainBatch,
    TrajectoryReward,
)
from loom.treerl import node_depths
from rollout_svc.engines.base import UnsupportedCapability
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.engines.vllm import VLLMEngine
from rollout_svc.modes import ModeError
from rollout_svc.modes import run as run_mode
from rollout_svc.modes.agent import MALFORMED, ToolCall, ToolError, calculate, parse_call
from rollout_svc.modes.scorers import ScorerError, http_scorer
from rollout_svc.modes.tree import first_token_containing
from tests.security import workers_fixtures
from zoo.tiny import CHECKPOINT_DIR, plain_prompt, tiny_problems

engine_url = workers_fixtures.engine_url  # a real `loom engine` on the tiny model (a subprocess)

PROMPT = plain_prompt(tiny_problems("arith", 1, seed=3)[0])  # "[plain] Compute 63+99.\n"


def _request(**mode_params: Any) -> RolloutRequest:
    base = {"parser": "inline", "max_turns": 16, "initial": 2, "branches": 2, "iterations": 2}
    return RolloutRequest(
        mode="agent_tree",
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=64, temperature=1.5, seed=5),
        mode_params=base | mode_params,
    )


def _calculated(expression: str) -> str:
    try:
        return calculate(expression)
    except ToolError as exc:  # arithmetic the calculator refuses: its message is the observation
        return f"error: {exc}"


def _group(engine: Any, settings: Settings | None = None, tokenizer: Any = None, **mode_params: Any) -> Group:
    request = _request(**mode_params)
    tok = tokenizer or engine.tokenizer
    ids = tok.encode(PROMPT, add_special_tokens=False)
    params = parse_mode_params(request)
    return run(run_mode(request, ids, "g", engine, lambda: tok, params, settings or Settings()))


# attention: delta 1 (the tiny model's episodes hold a handful of steps), nothing from "</think>" on
ATTENTION = {"strategy": "attention", "delta": 1, "entropy_stop_words": ["</think>"]}
STRATEGIES = {"entropy": {"strategy": "entropy"}, "turn": {"strategy": "turn"}, "attention": ATTENTION}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def group(request: pytest.FixtureRequest, tiny_engine: Any) -> Group:
    return _group(tiny_engine, **STRATEGIES[request.param])


def test_leaves_are_exact_and_share_their_parents_prefixes(group, tiny_engine):
    tok, by_id = tiny_engine.tokenizer, {t.id: t for t in group.trajectories}
    assert group.mode == "agent_tree" and len(group.trajectories) > 2  # roots and branches
    for t in group.trajectories:
        turns = [s for s in t.segments if s.kind == "turn"]
        obs = [s for s in t.segments if s.kind == "observation"]
        # policy and observation segments tile the completion in order
        spans = sorted((s.start, s.end) for s in turns + obs)
        assert spans[0][0] == 0 and spans[-1][1] == len(t.completion_ids)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
        for o in obs:  # each observation is the calculator's answer to the turn before it, encoded alone
            turn = next(s for s in turns if s.end == o.start)
            call = turn.meta["tool_call"]
            want = MALFORMED if call is None else _calculated(call["arguments"]["expression"])
            assert t.completion_ids[o.start : o.end] == tok.encode(want, add_special_tokens=False)
        assert t.loss_mask == [
            0 if any(o.start <= i < o.end for o in obs) else 1 for i in range(len(t.loss_mask))
        ]
        assert env_mask(t) == t.loss_mask
        if t.parent_id is None:
            continue
        parent, b = by_id[t.parent_id], t.meta["branch_point"]
        assert t.completion_ids[:b] == parent.completion_ids[:b]
        assert t.logprobs[:b] == parent.logprobs[:b]
        shared = [s for s in parent.segments if s.kind == "observation" and s.end <= b]
        assert [s for s in t.segments if s.kind == "observation" and s.end <= b] == shared  # run once
    # the engine's tokens after a branch point are the policy's: teacher-forced log-probs agree
    child = max((t for t in group.trajectories if t.parent_id), key=lambda t: len(t.completion_ids))
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    want = teacher_forced_logprobs(tiny_engine.model, prompt_ids + child.completion_ids, len(prompt_ids))
    own = [i for i, m in enumerate(child.loss_mask) if m and i >= child.meta["branch_point"]]
    assert [child.logprobs[i] for i in own] == pytest.approx([want[i] for i in own], abs=1e-4)
    meta = group.meta
    assert meta["tokens_generated"] < meta["tokens_independent"]
    assert meta["tool_calls_run"] < meta["tool_calls_independent"]  # a shared prefix's calls ran once


def test_the_tree_names_its_nodes_on_every_trajectory(group):
    depth = node_depths(group.tree or [])  # a tree: no cycle, no unknown parent
    nodes = {n.id: n for n in group.tree or []}
    for t in group.trajectories:
        tn = [s for s in t.segments if s.kind == "tree_node"]
        assert tn[0].start == 0 and tn[-1].end == len(t.completion_ids)
        assert all(a.end == b.start for a, b in zip(tn, tn[1:], strict=False))
        ids = [s.meta["node"] for s in tn]
        assert [depth[i] for i in ids] == list(range(1, len(ids) + 1))
        assert all(nodes[b].parent == a for a, b in zip(ids, ids[1:], strict=False))
        for s in tn:  # a node's span holds its owner's tokens, which this path repeats
            owner = next(u for u in group.trajectories if u.id == nodes[s.meta["node"]].trajectory_id)
            assert owner.completion_ids[s.start : s.end] == t.completion_ids[s.start : s.end]
        if t.parent_id is not None:
            assert t.meta["branch_point"] in {s.start for s in tn}  # a node boundary


def _rewards(group: Group) -> list[RewardResult]:
    return [
        RewardResult(
            group_id=group.id,
            rewards=[
                TrajectoryReward(
                    trajectory_id=t.id, total=float(i % 3 == 0), components={"accuracy": float(i % 3 == 0)}
                )
                for i, t in enumerate(group.trajectories)
            ],
        )
    ]


def test_node_advantages_are_treerl_on_the_leaves_rewards(group):
    rewards = _rewards(group)
    value = {r.trajectory_id: r.total for r in rewards[0].rewards}
    batch = TrainBatch(step=0, groups=[group], rewards=rewards, estimator="treerl")
    assigned = {s.trajectory.id: s for s in assign_batch(batch, drop_zero=False).samples}
    client, _ = tree_advantages(group, {r.trajectory_id: r for r in rewards[0].rewards})
    # eq. 2-3 by hand from the segments: L(s) = the trajectories whose path names s
    under: dict[str, list[float]] = {}
    for t in group.trajectories:
        for s in t.segments:
            if s.kind == "tree_node":
                under.setdefault(s.meta["node"], []).append(value[t.id])
    parent = {n.id: n.parent for n in group.tree or []}
    v_root = sum(value.values()) / len(value)
    v = {n: sum(x) / len(x) for n, x in under.items()}
    adv = {
        n: (2 * v[n] - v_root - (v_root if parent[n] is None else v[parent[n]])) / math.sqrt(len(x))
        for n, x in under.items()
    }
    for t in group.trajectories:
        want = [0.0] * len(t.completion_ids)
        for s in t.segments:
            if s.kind == "tree_node":
                want[s.start : s.end] = [adv[s.meta["node"]]] * (s.end - s.start)
        want = [a * m for a, m in zip(want, t.loss_mask or [], strict=True)]  # observations: 0
        assert assigned[t.id].adv == pytest.approx(want) and client[t.id] == pytest.approx(want)
        assert assigned[t.id].mask == t.loss_mask


def _learner(tmp_path, name: str) -> Learner:
    return Learner(LearnerSettings(model=CHECKPOINT_DIR, store=tmp_path / name, token_budget=4096, seed=0))


def _weights(learner: Learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


def test_the_learner_trains_the_tree_and_observations_carry_no_gradient(tiny_engine, tmp_path):
    group = _group(tiny_engine, strategy="turn", iterations=1, initial=1)
    rewards = _rewards(group)
    t = next(t for t in group.trajectories if any(s.kind == "observation" for s in t.segments))
    obs = next(s for s in t.segments if s.kind == "observation")
    turn = next(s for s in t.segments if s.kind == "turn")

    def step(name: str, change: slice | None) -> tuple[Any, list[torch.Tensor]]:
        g = group.model_copy(deep=True)
        if change is not None:  # other behaviour log-probs on these tokens only (lower: TIS weight 2)
            u = next(x for x in g.trajectories if x.id == t.id)
            u.logprobs[change] = [x - 3.0 for x in u.logprobs[change]]
        learner = _learner(tmp_path, name)
        loss = LossSpec(tis="sequence")  # each sequence weighted by its tokens' behaviour log-probs
        result = learner.train_step(
            TrainBatch(step=0, groups=[g], rewards=rewards, estimator="treerl", loss=loss)
        )
        return result, _weights(learner)

    base, w0 = step("a", None)
    assert base.policy_version == 1 and base.metrics["samples"] == len(group.trajectories)
    assert base.n_tokens == sum(sum(x.loss_mask or []) for x in group.trajectories)  # no observation
    _, w_obs = step("b", slice(obs.start, obs.end))  # masked tokens: the very same update
    assert all(torch.equal(a, b) for a, b in zip(w0, w_obs, strict=True))
    _, w_turn = step("c", slice(turn.start, turn.end))  # a policy token's change moves the update
    assert not all(torch.equal(a, b) for a, b in zip(w0, w_turn, strict=True))


def _assert_attention_points(group: Group, tokenizer: Any) -> None:
    """Every branch point is a reasoning step's start inside a policy turn (a turn's first token or
    the token after a separator), before the stop word, and the step's FCI is one that chose it."""
    by_id = {t.id: t for t in group.trajectories}
    steps, fci = group.meta["steps"], group.meta["fci"]
    n_points = 0
    for tid, points in group.meta["branch_points"].items():
        t = by_id[tid]
        texts = [tokenizer.decode([i], skip_special_tokens=False) for i in t.completion_ids]
        turns = [s for s in t.segments if s.kind == "turn"]
        obs = [s for s in t.segments if s.kind == "observation"]
        spans = [tuple(x) for x in steps[tid]]
        # the steps tile the turns exactly; each ends a turn or after a newline (the separators)
        assert sorted(spans) == spans and len(spans) == len(fci[tid])
        for turn in turns:
            inner = [(a, b) for a, b in spans if turn.start <= a < turn.end]
            assert inner[0][0] == turn.start and inner[-1][1] == turn.end
            assert all(x[1] == y[0] for x, y in zip(inner, inner[1:], strict=False))
            assert all("".join(texts[turn.start : b]).endswith("\n") for _, b in inner[:-1])
        assert not any(o.start <= a < o.end for a, _ in spans for o in obs)  # never a step start
        stop = first_token_containing(texts, "</think>")
        for b in points:
            n_points += 1
            assert b in [a for a, _ in spans] and fci[tid][[a for a, _ in spans].index(b)] > 0.0
            assert any(s.start <= b < s.end for s in turns) and not any(o.start <= b < o.end for o in obs)
            assert stop is None or b < stop
    assert n_points > 0, "attention found no branch point"
    for t in group.trajectories:
        if t.parent_id is not None:
            assert t.meta["strategy"] == "attention" and t.meta["branch_fci"] > 0.0
            assert t.meta["branch_fci"] in fci[t.parent_id]
    assert group.meta["strategy"] == "attention"


def test_attention_branches_at_step_starts_inside_policy_turns(group, tiny_engine):
    if group.meta["strategy"] != "attention":
        pytest.skip("the attention strategy's own rules")
    _assert_attention_points(group, tiny_engine.tokenizer)
    # the FCI is the scorer's over the whole episode: prompt step, then the steps; observations read
    prompt_ids = tiny_engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    t = next(t for t in group.trajectories if t.id in group.meta["branch_points"])
    n, spans = len(prompt_ids), group.meta["steps"][t.id]
    direct = run(
        tiny_engine.score_attention(
            prompt_ids + t.completion_ids, [(0, n)] + [(n + a, n + b) for a, b in spans], 1, None
        )
    )
    got = group.meta["fci"][t.id]
    assert [g for g in got if g > 0.0] == pytest.approx(
        [d for d, g in zip(direct[1:], got, strict=True) if g > 0.0], abs=1e-5
    )


def test_attention_on_the_operators_scorer_route_and_its_typed_outcomes(engine_url, tiny_engine):
    """An engine without scores (Loom's vLLM client on a real ``loom engine``): the FCI comes from the
    operator's ``LOOM_ATTENTION_URL`` route; without one the group is refused before any token is
    sampled (``UnsupportedCapability``, 422), and a scorer that cannot be reached is a ``ScorerError``."""
    tok, params = tiny_engine.tokenizer, ATTENTION | {"iterations": 1}

    def engine() -> VLLMEngine:  # one client per event loop (each _group runs its own)
        return VLLMEngine(engine_url, timeout=60, retries=0)

    group = _group(engine(), Settings(attention_url=engine_url), tok, **params)
    _assert_attention_points(group, tok)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    by_id = {t.id: t for t in group.trajectories}
    for t in group.trajectories:
        if t.parent_id is not None:  # the child's completion: the parent's exact ids, then its own
            b = t.meta["branch_point"]
            assert t.completion_ids[:b] == by_id[t.parent_id].completion_ids[:b]
    tid = next(iter(group.meta["branch_points"]))
    n, spans = len(prompt_ids), group.meta["steps"][tid]
    route = http_scorer(engine_url)
    direct = run(
        route(prompt_ids + by_id[tid].completion_ids, [(0, n)] + [(n + a, n + b) for a, b in spans], 1, None)
    )
    got = group.meta["fci"][tid]
    assert [g for g in got if g > 0.0] == pytest.approx(
        [d for d, g in zip(direct[1:], got, strict=True) if g > 0.0], abs=1e-5
    )
    with pytest.raises(UnsupportedCapability, match="attention_scores.*LOOM_ATTENTION_URL"):
        _group(VLLMEngine("http://127.0.0.1:9"), Settings(attention_url=""), tok, **params)
    with pytest.raises(ScorerError, match="could not be reached"):
        _group(engine(), Settings(attention_url="http://127.0.0.1:9"), tok, **params)


def test_bad_params_are_refused_naming_the_field():
    for bad, field in [
        ({"strategy": "random"}, "strategy"),
        ({"quantile": 1.5}, "quantile"),
        ({"delta": 0}, "delta"),
        ({"separator": ""}, "separator"),
        ({"attention_timeout_s": 1e9}, "attention_timeout_s"),
        ({"attention_url": "http://127.0.0.1:9"}, "attention_url is not accepted"),
        ({"continuations": 0}, "continuations"),
        ({"branches": -1}, "branches"),
        ({"parser": "xml"}, "parser"),
        ({"environment": "counter"}, "environment"),
        ({"tools": ["shell"]}, "shell"),
    ]:
        with pytest.raises(ModeError, match=field):
            parse_mode_params(_request(**bad))
    assert parse_mode_params(_request(initial=None)).initial == 6  # type: ignore[union-attr]


def test_a_non_replayable_environment_is_refused_by_the_params_model():
    """An environment's state is not in the ids a child copies: a tree reopens and replays it, so only
    a replayable one is accepted (tests/env/test_tree_replay.py runs them); a library's is refused."""
    with pytest.raises(ModeError, match="mode_params.environment 'verifiers:wordle' cannot branch"):
        parse_mode_params(_request(environment="verifiers:wordle"))
    params = parse_mode_params(_request(environment="countdown"))
    assert isinstance(params, AgentTreeParams) and params.environment == "countdown"


def test_the_inline_parser_calls_the_calculator_on_what_precedes_the_equals_sign():
    assert parse_call("<think> 3+9+0=", "inline") == ToolCall("calculator", {"expression": "3+9+0"})
    assert parse_call("- yes (5*3)+7=", "inline") == ToolCall("calculator", {"expression": "(5*3)+7"})
    assert parse_call("x =", "inline") is None  # nothing to compute: a malformed call
    assert parse_call("3+4", "inline") is None


def test_the_charge_is_every_episode_of_every_tree_at_agents_bound():
    params = parse_mode_params(_request(initial=3, branches=2, continuations=2, iterations=2))
    episodes = 3 * (1 + 2 * 2 * 2)
    assert per_sample(params, 64) == (episodes, episodes * min(16 * 64, 8192))
