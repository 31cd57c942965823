"""A job's charge by its mode's worst case (gateway/cost.py), from the typed mode parameters the
submission resolved, and what a group produced."""

from __future__ import annotations

from gateway.cost import group_budget, job_budget, produced
from gateway.models import JobRequest
from gateway.validate import check_submission
from loom.contracts.settings import Settings
from loom.contracts.wire import Group, RolloutRequest, Trajectory


def _checked(body: dict[str, object]) -> JobRequest:
    req = JobRequest.model_validate({"job_key": "k", **body})
    checked = check_submission(req.items(), req, Settings(), None)
    assert checked.problem is None, checked.problem
    return checked.request  # type: ignore[no-any-return]


def _budget(body: dict[str, object]) -> tuple[int, int]:
    req = _checked(body)
    cost = job_budget(req, req.items())
    return cost.samples, cost.tokens


def test_plain_is_n_samples_of_max_tokens() -> None:
    assert _budget({"prompts": ["a", "b"], "sampling": {"n": 3, "max_tokens": 10}}) == (6, 60)


def test_tree_is_every_path_whatever_n() -> None:
    tree = {"mode": "tree", "mode_params": {"branches": 3, "continuations": 2, "iterations": 2}}
    # n=1: initial defaults to 6; 6 x (1 + 2 x 3 x 2) paths of at most 16 tokens each
    assert _budget({"prompts": ["a"], "sampling": {"n": 1, "max_tokens": 16}, **tree}) == (78, 78 * 16)
    # n=4: initial follows n
    assert _budget({"prompts": ["a"], "sampling": {"n": 4, "max_tokens": 16}, **tree})[0] == 4 * 13


def test_spawn_counts_children_and_their_tokens() -> None:
    spawn = {"mode": "spawn", "mode_params": {"max_children": 3, "max_depth": 2, "child_max_tokens": 5}}
    body = {"prompts": ["a"], "sampling": {"n": 2, "max_tokens": 20}, **spawn}
    assert _budget(body) == (2 * (1 + 3 + 9), 2 * (20 + 12 * 5))
    capped = {**spawn, "mode_params": {**spawn["mode_params"], "max_total_tokens": 30}}  # type: ignore[dict-item]
    assert _budget({**body, **capped}) == (26, 2 * 30)


def test_agent_counts_every_turn_within_the_episode_bound() -> None:
    agent = {"mode": "agent", "mode_params": {"max_turns": 4}}
    body = {"prompts": ["a"], "sampling": {"n": 2, "max_tokens": 20}, **agent}
    assert _budget(body) == (2, 2 * 4 * 20)
    capped = {**agent, "mode_params": {"max_turns": 4, "max_total_tokens": 50}}
    assert _budget({**body, **capped}) == (2, 2 * 50)


def test_streaming_counts_every_round() -> None:
    streaming = {
        "mode": "streaming",
        "mode_params": {"context": "One. Two. Three.", "segment_cap": 8, "answer_max_tokens": 4},
    }
    body = {"prompts": ["a"], "sampling": {"n": 2, "max_tokens": 32}, **streaming}
    assert _budget(body) == (2, 2 * (3 * 8 + 32 + 4))  # deep phase: max_tokens by default


def test_adaptive_rounds_and_reflection_count() -> None:
    adaptive = {"adaptive": {"samples_per_round": 4, "max_rounds": 3}}
    assert _budget({"prompts": ["a", "b"], "sampling": {"max_tokens": 10}, **adaptive}) == (24, 240)
    reflect = {"reflect": {"max_tokens": 7}}
    assert _budget({"prompts": ["a"], "sampling": {"n": 2, "max_tokens": 10}, **reflect}) == (4, 20 + 14)


def test_a_request_not_resolved_is_parsed_for_its_budget() -> None:
    request = RolloutRequest(
        mode="tree", prompt="a", sampling={"n": 1, "max_tokens": 8}, mode_params={"initial": 2}
    )
    assert (group_budget(request).samples, group_budget(request).tokens) == (2 * 5, 80)


def test_produced_counts_trajectories_and_their_trained_tokens() -> None:
    plain = Trajectory(id="t0", group_id="g", completion_ids=[1, 2, 3])
    masked = Trajectory(id="t1", group_id="g", completion_ids=[1, 2, 3, 4], loss_mask=[1, 0, 0, 1])
    got = produced([Group(id="g", prompt="a", trajectories=[plain, masked])])
    assert (got.samples, got.tokens) == (2, 5)
