"""agent_tree over environments by replay, end to end: a real ``loom worker env`` on RabbitMQ, trees
of episodes on Loom's tiny model in the real torch engine. A child reopens its tree's environment and
replays its parent's actions: its later observations are the environment's own answers (the tries it
counts go on from the replayed ones), a replay answered otherwise ends the child typed, a
non-replayable environment is refused, node advantages are TreeRL's. Nothing is mocked."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from typing import Any

import pytest

from env_svc.countdown import CountdownEnv
from learner.assign import assign_batch
from loom.clients.rollouts import tree_advantages
from loom.contracts.envs import EnvAction, EnvTask, ToolCallBody
from loom.contracts.modes import ModeError, parse_mode_params
from loom.contracts.settings import Settings
from loom.contracts.wire import (
    Group,
    RewardResult,
    RolloutRequest,
    SamplingParams,
    TrainBatch,
    TrajectoryReward,
)
from rollout_svc.modes import run as run_mode
from rollout_svc.modes.agent import Agent, Observation
from rollout_svc.modes.env_replay import REPLAY_MISMATCH
from tests.conftest import BrokerEnv, Worker
from tests.env.test_tier import tier
from zoo.tiny import plain_prompt, tiny_problems

PROMPT = plain_prompt(tiny_problems("arith", 1, seed=3)[0])
COUNTDOWN = {"numbers": [162], "target": 162, "max_tries": 4}


@pytest.fixture(scope="module")
def replay_tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerEnv, list[Worker]]]:
    with tier(tmp_path_factory.mktemp("replay-tier")) as t:
        yield t


def _request(environment: str, **mode_params: Any) -> RolloutRequest:
    base = {
        "parser": "hermes",
        "max_turns": 4,
        "initial": 2,
        "branches": 2,
        "iterations": 1,
        "strategy": "turn",
    }
    return RolloutRequest(
        mode="agent_tree",
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=24, temperature=1.5, seed=5),
        mode_params=base | {"environment": environment} | mode_params,
    )


def _tree(engine: Any, request: RolloutRequest) -> Group:
    ids = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = parse_mode_params(request)
    return asyncio.run(run_mode(request, ids, "g", engine, lambda: engine.tokenizer, params, Settings()))


@pytest.fixture(scope="module")
def countdown_tree(replay_tier, tiny_engine) -> tuple[Group, RolloutRequest]:
    request = _request("countdown", env_options=COUNTDOWN)
    return _tree(tiny_engine, request), request


def _turns_before(t: Any, b: int) -> int:
    return sum(s.kind == "turn" and s.end <= b for s in t.segments)


def test_a_childs_observations_after_its_branch_are_the_environments_own(countdown_tree, tiny_engine) -> None:
    group, request = countdown_tree
    runner = Agent(request, tiny_engine, tiny_engine.tokenizer, parse_mode_params(request))  # type: ignore[arg-type]
    tok, by_id = tiny_engine.tokenizer, {t.id: t for t in group.trajectories}
    children = [t for t in group.trajectories if t.parent_id is not None]
    assert children and all(t.stop_reason in ("env_done", "max_turns") for t in group.trajectories)
    live = 0
    for t in group.trajectories:
        # the countdown environment, stepped here on the trajectory's own actions, answers each turn
        # as the tier's did: the copied prefix's (replayed) and the child's own after its branch
        env = CountdownEnv()
        env.reset(EnvTask(environment="countdown", options=COUNTDOWN))
        turns = [s for s in t.segments if s.kind == "turn"]
        obs = {s.start: s for s in t.segments if s.kind == "observation"}
        for s in turns:
            call = s.meta["tool_call"]
            text = tok.decode(t.completion_ids[s.start : s.end], skip_special_tokens=False)
            body = None if call is None else ToolCallBody(**call)
            step = env.step(EnvAction(text=text, tool_call=body, turn=s.index))
            assert s.meta["reward"] == step.reward and s.meta["env_status"] == "ok"
            if step.done:
                assert s is turns[-1] and t.stop_reason == "env_done"
                continue
            o = obs[s.end]
            want, _ = runner.observation(Observation(step.observation, "ok"))
            assert t.completion_ids[o.start : o.end] == want
            live += t.parent_id is not None and s.start >= t.meta["branch_point"]
        assert t.meta["turn_rewards"] == [s.meta["reward"] for s in turns] and t.meta["env_steps"] == len(
            turns
        )
        if t.parent_id is not None:
            b = t.meta["branch_point"]
            assert t.completion_ids[:b] == by_id[t.parent_id].completion_ids[:b]
            assert _turns_before(t, b) >= 1  # turn strategy: after an observation, so a replay ran
    assert live > 0, "no child stepped its environment after its branch point"
    # each child's replay: its prefix's turns, stepped again on a fresh episode
    assert group.meta["env_steps_replayed"] == sum(_turns_before(t, t.meta["branch_point"]) for t in children)


def test_node_advantages_are_treerl_over_the_environments_tree(countdown_tree) -> None:
    group, _ = countdown_tree
    value = {t.id: float(i % 3 == 0) for i, t in enumerate(group.trajectories)}
    rewards = [
        RewardResult(
            group_id=group.id,
            rewards=[
                TrajectoryReward(trajectory_id=k, total=v, components={"accuracy": v})
                for k, v in value.items()
            ],
        )
    ]
    batch = TrainBatch(step=0, groups=[group], rewards=rewards, estimator="treerl")
    assigned = {s.trajectory.id: s for s in assign_batch(batch, drop_zero=False).samples}
    client, _ = tree_advantages(group, {r.trajectory_id: r for r in rewards[0].rewards})
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
    assert any(p is not None for p in parent.values())  # children's nodes hang from their parents'
    for t in group.trajectories:
        want = [0.0] * len(t.completion_ids)
        for s in t.segments:
            if s.kind == "tree_node":
                want[s.start : s.end] = [adv[s.meta["node"]]] * (s.end - s.start)
        want = [a * m for a, m in zip(want, t.loss_mask or [], strict=True)]  # observations: 0
        assert assigned[t.id].adv == pytest.approx(want) and client[t.id] == pytest.approx(want)


def test_a_replay_answered_otherwise_ends_the_child_typed(replay_tier, tiny_engine) -> None:
    """``Drifts`` says it is replayable but names the episode in each answer: every child's replay
    differs at its first step; the child ends there, its unsent turn kept, and is never branched."""
    group = _tree(tiny_engine, _request("tests.env.faulty:Drifts", iterations=2))
    by_id = {t.id: t for t in group.trajectories}
    roots = [t for t in group.trajectories if t.parent_id is None]
    children = [t for t in group.trajectories if t.parent_id is not None]
    assert len(roots) == 2 and all(t.stop_reason == "max_turns" for t in roots) and children
    for t in children:
        assert (t.stop_reason, t.finish_reason) == (REPLAY_MISMATCH, "abort")
        assert t.meta["env_error"].startswith("turn 0: the observation differs")
        assert by_id[t.parent_id].parent_id is None  # a mismatched child is no branch point
        b = t.meta["branch_point"]
        (last,) = [s for s in t.segments if s.kind == "turn" and s.end > b]
        assert last.end == len(t.completion_ids) and last.meta["status"] == "not_sent"
        assert t.completion_ids[:b] == by_id[t.parent_id].completion_ids[:b]
        assert t.meta["turn_rewards"] == [0.5] * _turns_before(t, b)  # the prefix's, as the parent's
    assert group.meta["env_steps_replayed"] == len(children)  # each stopped at its first step


def test_a_non_replayable_environment_is_refused(replay_tier, tiny_engine) -> None:
    for name in ("verifiers:wordle", "skyrl:gsm8k"):  # a library's: refused with the request
        with pytest.raises(ModeError, match="mode_params.environment"):
            parse_mode_params(_request(name))
    # a deployment's own, without ``replayable``: the env worker refuses its open, typed
    group = _tree(tiny_engine, _request("tests.env.faulty:NeverDone"))
    assert [t.stop_reason for t in group.trajectories] == ["not_replayable"] * 2
    assert all("not replayable" in t.meta["env_error"] for t in group.trajectories)


def test_a_chat_environment_prompts_the_agent_and_no_tree_replays_it(replay_tier, tiny_engine) -> None:
    """A system prompt in the reset's ``chat`` (docs/environments.md "The policy's prompt"): an agent
    episode's prompt is the tiny template's system line then the request's prompt; a tree's roots
    end ``env_error`` before their first turn."""
    request = RolloutRequest(
        mode="agent",
        prompt=PROMPT,
        sampling=SamplingParams(max_tokens=8, temperature=0.0, seed=5),
        mode_params={"environment": "tests.env.faulty:ChatReplayable", "max_turns": 1},
    )
    (t,) = _tree(tiny_engine, request).trajectories
    want = tiny_engine.tokenizer.encode("Answer briefly.\n" + PROMPT, add_special_tokens=False)
    assert t.prompt_ids == want and t.meta["env_prompt"] == "template" and t.stop_reason == "max_turns"
    group = _tree(tiny_engine, _request("tests.env.faulty:ChatReplayable"))
    assert [t.stop_reason for t in group.trajectories] == ["env_error"] * 2
    assert all("cannot be replayed" in t.meta["env_error"] for t in group.trajectories)
