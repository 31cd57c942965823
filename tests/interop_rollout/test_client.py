"""The rollout client for trainers (loom.clients.rollouts) against a live Loom deployment: the embedded
broker, a real rollout worker (torch engine, the built-in tiny model), a real reward worker and the
gateway. Many prompts per call in every mode, token-exact results (behaviour log-probs equal the tiny
model's teacher-forced ones), masks, versions, rewards, TreeRL advantages equal to the learner's, the
asyncio client, and groups that arrive while the job is still running."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from learner.estimators.treerl import assign as treerl_assign
from loom.clients.base import LoomHTTPError
from loom.clients.rollouts import AsyncRollouts, RolloutGroup, Rollouts, env_mask, job_body, trained_mask
from loom.contracts.estimators import TreerlParams
from loom.contracts.modes import TreeParams
from loom.contracts.wire import Segment, Trajectory
from tests.interop_rollout.loom_stack import TRAINER_KEY, LoomStack
from zoo.tiny import STREAM_HEADER, load_model, load_tokenizer, make_problems, plain_prompt, spawn_prompt
from zoo.tiny.traces import stream_sentences

pytestmark = pytest.mark.slow

ATOL = 1e-4
SAMPLING = {"n": 4, "max_tokens": 64, "temperature": 1.0, "seed": 3}
TREE = {"strategy": "random", "branches": 1, "continuations": 2, "min_distance": 4}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomStack]:
    with LoomStack(tmp_path_factory.mktemp("rollouts")) as s:
        yield s


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return load_model().eval()


def arith_tasks(k: int, seed: int = 0) -> list[dict[str, Any]]:
    return [
        {"prompt": plain_prompt(p), "label": p.gold, "task": "arithmetic"}
        for p in make_problems("arith", k, seed=seed)
    ]


def stream_tasks(k: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": STREAM_HEADER,
            "label": p.gold,
            "task": "arithmetic",
            "mode_params": {"sentences": stream_sentences(p), "segment_cap": 32, "answer_max_tokens": 16},
        }
        for p in make_problems("arith", k, seed=1)
    ]


def spawn_tasks(k: int) -> list[dict[str, Any]]:
    return [
        {
            "prompt": spawn_prompt(p),
            "label": json.dumps({"numbers": list(p.numbers), "target": p.target}),
            "task": "countdown",
        }
        for p in make_problems("countdown", k, seed=3)
    ]


CALLS: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] = {
    "plain": (arith_tasks(3), {}, SAMPLING),
    "streaming": (stream_tasks(3), {}, dict(SAMPLING, n=2, max_tokens=96)),
    "tree": (arith_tasks(3, seed=5), TREE, SAMPLING),
    "spawn": (spawn_tasks(2), {}, dict(SAMPLING, n=2, max_tokens=200)),
}


def teacher_forced(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [float(logp[n + j - 1, tok]) for j, tok in enumerate(completion_ids)]


def check_sample_contract(g: RolloutGroup, model: Any) -> None:
    assert g.group is not None and g.rewards is not None
    assert {r.trajectory_id for r in g.rewards.rewards} == {s.id for s in g.samples}
    for s in g.samples:
        n = len(s.completion_ids)
        assert n > 0 and s.prompt_ids
        assert s.logprobs is not None and len(s.logprobs) == n
        assert len(s.loss_mask) == n and len(s.env_mask) == n
        assert set(s.loss_mask) <= {0, 1} and set(s.env_mask) <= {0, 1}
        assert s.policy_version == 0
        assert s.reward is not None and s.reward_status is not None and "accuracy" in s.components
        # token-exact: every token the policy sampled has the tiny model's own log-prob
        ref = teacher_forced(model, s.prompt_ids, s.completion_ids)
        sampled = [j for j in range(n) if s.env_mask[j]]
        assert sampled
        assert [s.logprobs[j] for j in sampled] == pytest.approx([ref[j] for j in sampled], abs=ATOL)
        # inserted tokens were not sampled: no behaviour log-prob, never trained
        assert all(s.logprobs[j] == 0.0 and not s.loss_mask[j] for j in range(n) if not s.env_mask[j])


@pytest.mark.parametrize("mode", list(CALLS))
def test_one_call_many_prompts_is_token_exact_in_every_mode(stack: LoomStack, model: Any, mode: str) -> None:
    tasks, params, sampling = CALLS[mode]
    tok = load_tokenizer()
    with Rollouts(stack.url, TRAINER_KEY) as rollouts:
        groups = rollouts.generate(tasks, mode=mode, mode_params=params, sampling=sampling)
    assert [g.index for g in groups] == list(range(len(tasks)))
    for g, task in zip(groups, tasks, strict=True):
        assert g.group is not None and g.group.mode == mode
        assert g.group.prompt == task["prompt"] and g.group.label == task["label"]
        check_sample_contract(g, model)
        for s in g.samples:
            assert (
                s.prompt_ids == tok.encode(task["prompt"], add_special_tokens=False) or s.trajectory.parent_id
            )
    samples = [s for g in groups for s in g.samples]
    if mode == "plain":
        assert all(len(g.samples) == sampling["n"] for g in groups)
        assert all(s.advantages is None and all(s.env_mask) and all(s.loss_mask) for s in samples)
    if mode == "streaming":
        for s, task in ((s, t) for g, t in zip(groups, tasks, strict=True) for s in g.samples):
            observed = [
                s.completion_ids[seg.start : seg.end] for seg in s.segments if seg.kind == "observation"
            ]
            # the context sentences are in the completion, as observations: env_mask 0 on each of them
            shown = [tok.decode(ids) for ids in observed]
            for sentence in task["mode_params"]["sentences"]:
                assert any(sentence in text for text in shown)
            for seg in s.segments:
                if seg.kind == "observation":
                    assert not any(s.env_mask[seg.start : seg.end])
                    assert not any(s.loss_mask[seg.start : seg.end])
            assert any(seg.kind == "stream" for seg in s.segments)
    if mode == "tree":
        assert any(s.trajectory.parent_id is not None for s in samples), "no tree branched"
        for g in groups:
            assert g.group is not None and g.group.tree and g.node_values is not None
            assert g.rewards is not None
            by_id = {r.trajectory_id: r for r in g.rewards.rewards}
            learner = {ta.trajectory.id: ta.adv for ta in treerl_assign(g.group, by_id, TreerlParams())}
            for s in g.samples:
                assert s.advantages == pytest.approx(learner[s.id], abs=1e-9)
            # branches share their parent's prefix token for token
            for s in g.samples:
                parent_id = s.trajectory.parent_id
                if parent_id is not None:
                    parent = next(p for p in g.samples if p.id == parent_id)
                    cut = int(s.trajectory.meta["branch_point"])
                    assert s.completion_ids[:cut] == parent.completion_ids[:cut]
    if mode == "spawn":
        for g in groups:
            roots = [s for s in g.samples if s.trajectory.parent_id is None]
            assert len(roots) == sampling["n"]
            assert g.group is not None and g.group.threads is not None
            assert {link.child for link in g.group.threads} == {
                s.id for s in g.samples if s.trajectory.parent_id is not None
            }
        joined = [s for s in samples if any(seg.kind == "observation" for seg in s.segments)]
        assert joined, "no parent joined its children"
        for s in joined:
            assert 0 in s.env_mask  # the join block was inserted, not sampled


def test_groups_arrive_while_the_job_is_still_running(stack: LoomStack) -> None:
    tasks = arith_tasks(24, seed=11)  # three waves of the gateway's 8 prompts in flight per job
    seen: list[int] = []
    done_at_first: int | None = None
    with Rollouts(stack.url, TRAINER_KEY) as rollouts:
        job_id = rollouts.submit(tasks, sampling=dict(SAMPLING, n=2))
        for g in rollouts.groups(job_id):
            if done_at_first is None:
                view = stack.job(job_id)
                done_at_first = view["n_done"]
            seen.append(g.index)
    assert sorted(seen) == list(range(24))
    assert done_at_first is not None and done_at_first < 24, "the first group came only after the whole job"


def test_a_dropped_stream_goes_on_after_the_last_group_it_got(stack: LoomStack) -> None:
    """The gateway is killed (-9) after the first group and started again: the client reconnects with
    Last-Event-ID and gets every group exactly once."""
    tasks = arith_tasks(24, seed=13)
    seen: list[int] = []
    with Rollouts(stack.url, TRAINER_KEY, reconnects=60) as rollouts:
        job_id = rollouts.submit(tasks, sampling=dict(SAMPLING, n=2))
        for g in rollouts.groups(job_id):
            seen.append(g.index)
            if len(seen) == 1:
                stack.restart_gateway()
        assert rollouts.reconnections >= 1
    assert sorted(seen) == list(range(24)), seen
    assert stack.job(job_id)["status"] == "succeeded"


def test_the_async_stream_goes_on_after_a_dropped_connection_too(stack: LoomStack) -> None:
    async def main() -> tuple[list[int], int]:
        seen: list[int] = []
        async with AsyncRollouts(stack.url, TRAINER_KEY, reconnects=60) as rollouts:
            async for g in rollouts.stream(arith_tasks(24, seed=17), sampling=dict(SAMPLING, n=2)):
                seen.append(g.index)
                if len(seen) == 1:
                    await asyncio.to_thread(stack.restart_gateway)
            return seen, rollouts.reconnections

    seen, reconnections = asyncio.run(main())
    assert reconnections >= 1
    assert sorted(seen) == list(range(24)), seen


def test_async_client_runs_calls_concurrently(stack: LoomStack, model: Any) -> None:
    async def main() -> tuple[list[RolloutGroup], list[RolloutGroup], list[int]]:
        async with AsyncRollouts(stack.url, TRAINER_KEY) as rollouts:
            order: list[int] = []

            async def streamed() -> list[RolloutGroup]:
                out = []
                async for g in rollouts.stream(arith_tasks(4, seed=7), sampling=dict(SAMPLING, n=2)):
                    order.append(g.index)
                    out.append(g)
                return out

            tree = rollouts.generate(arith_tasks(2, seed=8), mode="tree", mode_params=TREE, sampling=SAMPLING)
            a, b = await asyncio.gather(streamed(), tree)
            return a, b, order

    plain, tree, order = asyncio.run(main())
    assert sorted(order) == [0, 1, 2, 3] and len(plain) == 4
    assert [g.index for g in tree] == [0, 1]
    for g in plain + tree:
        check_sample_contract(g, model)
    assert all(s.advantages is not None for g in tree for s in g.samples)


def test_typed_mode_params_are_sent_as_the_keys_that_differ(stack: LoomStack) -> None:
    params = TreeParams.model_validate({"strategy": "random", "branches": 1, "min_distance": 4})
    body = job_body(arith_tasks(1), mode="tree", mode_params=params, sampling=SAMPLING)
    # initial follows sampling.n and attention_timeout_s the deployment: the gateway fills both
    assert body["tasks"][0]["mode_params"] == {"strategy": "random", "branches": 1, "min_distance": 4}
    with Rollouts(stack.url, TRAINER_KEY) as rollouts:
        (g,) = rollouts.generate(arith_tasks(1), mode="tree", mode_params=params, sampling=SAMPLING)
    assert g.group is not None and g.group.meta["strategy"] == "random"


def test_a_bad_mode_parameter_is_the_gateways_422_naming_it(stack: LoomStack) -> None:
    """The client sends mode parameters as given; the gateway parses them once, at submission, and
    refuses a bad one before any job exists."""
    with Rollouts(stack.url, TRAINER_KEY) as rollouts:
        for kwargs, msg in (
            ({"mode": "streaming"}, "streaming needs mode_params.sentences"),
            ({"mode": "tree", "mode_params": {"branches": 100}}, "mode_params.branches must be in [0, 64]"),
        ):
            with pytest.raises(LoomHTTPError) as err:
                rollouts.submit([STREAM_HEADER], **kwargs)
            assert err.value.status == 422 and msg in json.dumps(err.value.body), err.value.body


def test_the_gateway_refusal_names_the_field(stack: LoomStack) -> None:
    with Rollouts(stack.url, TRAINER_KEY) as rollouts:
        with pytest.raises(LoomHTTPError) as err:
            rollouts.submit(arith_tasks(1), reward={"components": [{"name": "no_such_component"}]})
    assert err.value.status == 422 and "no_such_component" in json.dumps(err.value.body)


def test_masks_of_inserted_tokens() -> None:
    """env_mask: 0 on observations and on a revision's forced ending; a tree branch's untrained
    prefix was sampled (on its parent path): 1 there, but 0 in loss_mask."""
    revision = Trajectory(
        id="t.rev",
        group_id="g",
        completion_ids=[5, 6, 7, 8, 9, 10],
        loss_mask=[1, 1, 0, 0, 1, 1],
        segments=[Segment(kind="revision", start=2, end=6, meta={"forced_end": 4})],
    )
    assert env_mask(revision) == [1, 1, 0, 0, 1, 1] and trained_mask(revision) == [1, 1, 0, 0, 1, 1]
    branch = Trajectory(
        id="b",
        group_id="g",
        completion_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        segments=[Segment(kind="tree_node", start=0, end=2), Segment(kind="tree_node", start=2, end=4)],
    )
    assert env_mask(branch) == [1, 1, 1, 1] and trained_mask(branch) == [0, 0, 1, 1]
    streamed = Trajectory(
        id="s",
        group_id="g",
        completion_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 0, 1, 1, 0],  # an observation, two sampled tokens, a forced marker
        segments=[Segment(kind="observation", start=0, end=2), Segment(kind="stream", start=2, end=5)],
    )
    assert env_mask(streamed) == [0, 0, 1, 1, 0] and trained_mask(streamed) == [0, 0, 1, 1, 0]
