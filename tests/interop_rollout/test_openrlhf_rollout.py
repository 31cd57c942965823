"""OpenRLHF 0.11.2's rollout path drives ``LoomAgentExecutor`` (loom/clients/openrlhf_rollout.py)
against a live Loom deployment, in plain, streaming and tree modes, and at a published version.

OpenRLHF's own code, from the installed package (``openrlhf==0.11.2 --no-deps``, deploy/setup.sh):
``AgentExecutorBase`` and ``Experience``/``make_experience_batch``/``split_experience_batch`` are
imported; the functions that live in modules importing vLLM or DeepSpeed (neither installs on this
CPU host) are compiled from the installed files' own source, unchanged (``installed`` below), and
called as OpenRLHF calls them:

- ``openrlhf/trainer/ray/vllm_engine.py``: ``_load_agent_executor`` (runs ``--train.agent_func_path``,
  checks the ``AgentExecutorBase`` subclass) and ``RolloutRayActor.generate_responses`` (gathers
  ``num_samples`` concurrent ``execute`` calls of one prompt);
- ``openrlhf/trainer/ppo_utils/samples_generator.py``: ``SamplesGenerator._process_response_into_experience``
  (the ``Experience``: ``action_mask`` from ``action_ranges``, ``rollout_log_probs``, rewards, info);
- ``openrlhf/models/utils.py``: ``compute_reward`` (the reward on the last action token).

The ``sampling_params`` are the fields ``SamplesGenerator._dispatch_prompts_to_vllm`` sets on vLLM's
``SamplingParams`` (vLLM is absent: a namespace of the same fields). The teacher-forced reference is
OpenRLHF's alignment: position ``p`` of ``action_mask``/``rollout_log_probs`` scores ``sequences[p + 1]``.
"""

from __future__ import annotations

import ast
import asyncio
import itertools
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import openrlhf
import pytest
import torch
from openrlhf.trainer.ppo_utils import Experience, make_experience_batch
from openrlhf.trainer.ppo_utils.experience import split_experience_batch
from openrlhf.trainer.ppo_utils.length_penalty import apply_length_penalties
from openrlhf.utils.agent import AgentExecutorBase

from loom.clients.openrlhf_rollout import action_ranges
from loom.clients.policies import PolicyPublisher
from tests.interop_rollout.loom_stack import TRAINER, TRAINER_KEY, LoomStack
from zoo.tiny import STREAM_HEADER, load_model, load_tokenizer, make_problems, plain_prompt, spawn_prompt
from zoo.tiny.traces import stream_sentences

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ATOL = 1e-4
MAX_LEN = 1024  # OpenRLHF's max_len: nothing here is truncated by it
TREE = {"strategy": "random", "branches": 1, "continuations": 2, "min_distance": 4}
OPENRLHF = Path(openrlhf.__file__).parent


def installed(relpath: str, qualname: str, **names: Any) -> Any:
    """A function or class of the installed OpenRLHF, compiled from its own file (line numbers kept) with the
    module-level names it uses; its module cannot be imported here (vLLM / DeepSpeed)."""
    path = OPENRLHF / relpath
    body: list[ast.stmt] = ast.parse(path.read_text(), filename=str(path)).body
    node: ast.stmt | None = None
    for part in qualname.split("."):
        node = next(n for n in body if getattr(n, "name", None) == part)
        body = getattr(node, "body", [])
    assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    namespace: dict[str, Any] = dict(names)
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return namespace[node.name]


load_agent_executor = installed(
    "trainer/ray/vllm_engine.py", "_load_agent_executor", AgentExecutorBase=AgentExecutorBase
)
generate_responses = installed(
    "trainer/ray/vllm_engine.py", "RolloutRayActor.generate_responses", asyncio=asyncio
)
process_response = installed(
    "trainer/ppo_utils/samples_generator.py",
    "SamplesGenerator._process_response_into_experience",
    torch=torch,
    Experience=Experience,
)
compute_reward = installed("models/utils.py", "compute_reward", torch=torch)
masked_mean = installed("models/utils.py", "masked_mean", torch=torch, Optional=Optional)
aggregate_loss = installed("models/loss.py", "aggregate_loss", masked_mean=masked_mean, Optional=Optional)
PolicyLoss = installed(
    "models/loss.py",
    "PolicyLoss",
    torch=torch,
    nn=torch.nn,
    masked_mean=masked_mean,
    aggregate_loss=aggregate_loss,
    Optional=Optional,
)
MAKER = "trainer/ppo_utils/experience_maker.py"
maker_methods = {
    name: installed(
        MAKER,
        f"RemoteExperienceMaker.{name}",
        torch=torch,
        itertools=itertools,
        Experience=Experience,
        apply_length_penalties=apply_length_penalties,
        compute_reward=compute_reward,
        logger=logging.getLogger("openrlhf"),
        List=list,
        Tuple=tuple,
    )
    for name in ("split_rollout_samples", "compute_advantages_and_returns", "get_cumulative_returns")
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomStack]:
    with LoomStack(tmp_path_factory.mktemp("openrlhf-rollouts")) as s:
        yield s


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return load_model().eval()


def agent_file(tmp: Path, **config: Any) -> Path:
    """The file ``--train.agent_func_path`` names: its ``AgentExecutor`` built without arguments."""
    path = tmp / "loom_agent.py"
    path.write_text(
        "import json\n"
        "from loom.clients.openrlhf_rollout import LoomAgentExecutor\n\n"
        f"CONFIG = json.loads({json.dumps(config)!r})\n\n\n"
        "class AgentExecutor(LoomAgentExecutor):\n"
        "    def __init__(self):\n"
        "        super().__init__(**CONFIG)\n"
    )
    return path


def sampling_params(max_tokens: int) -> SimpleNamespace:
    """The fields SamplesGenerator._dispatch_prompts_to_vllm sets (is_correction_level on: logprobs=1)."""
    return SimpleNamespace(
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        max_tokens=max_tokens,
        min_tokens=1,
        skip_special_tokens=False,
        logprobs=1,
    )


def rollout(
    agent: Path, items: list[tuple[str, Any]], n: int, max_tokens: int
) -> tuple[list[Any], list[Any]]:
    """OpenRLHF's rollout path: one ``generate_responses`` per prompt, all at once (as Ray's async actor
    runs them), then ``_process_response_into_experience`` on each answer."""
    actor = SimpleNamespace(executor=load_agent_executor(str(agent)))
    tok = load_tokenizer()

    async def main() -> list[list[dict[str, Any]]]:
        calls = [
            generate_responses(
                actor,
                prompt=p,
                label=label,
                sampling_params=sampling_params(max_tokens),
                max_length=MAX_LEN,
                hf_tokenizer=tok,
                num_samples=n,
            )
            for p, label in items
        ]
        return list(await asyncio.gather(*calls))

    responses = [r for per_prompt in asyncio.run(main()) for r in per_prompt]
    return responses, [process_response(None, r, max_len=MAX_LEN) for r in responses]


def teacher_forced(model: Any, sequence: list[int]) -> list[float]:
    """log p(sequence[p + 1] | sequence[: p + 1]) for each p, as OpenRLHF's actor aligns it."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([sequence])).logits[0].float(), dim=-1)
    return [float(logp[p, sequence[p + 1]]) for p in range(len(sequence) - 1)]


def check_experiences(
    responses: list[dict[str, Any]], experiences: list[Any], model: Any, n: int, version: int
) -> None:
    assert len(responses) % n == 0
    for k in range(0, len(responses), n):  # OpenRLHF normalises over n consecutive samples: one group
        group = responses[k : k + n]
        assert len({r["loom"]["group_id"] for r in group}) == 1
        assert len({r["loom"]["trajectory_id"] for r in group}) == n
    assert len({r["loom"]["group_id"] for r in responses}) == len(responses) // n
    for r, e in zip(responses, experiences, strict=True):
        seq = r["observation_tokens"]
        t = len(seq)
        assert e.sequences.tolist() == [seq] and e.attention_mask.shape == (1, t)
        assert e.action_mask.shape == (1, t - 1) and e.rollout_log_probs.shape == (1, t - 1)
        assert r["loom"]["policy_version"] == version
        assert e.info["loom_policy_version"].tolist() == [float(version)]
        assert e.rewards.tolist() == [r["reward"]] and "accuracy" in e.info
        mask = e.action_mask[0].tolist()
        assert sum(mask) > 0
        # token-exact: every action token's behaviour log-prob is the served weights' teacher-forced one
        ref = teacher_forced(model, seq)
        acts = [p for p in range(t - 1) if mask[p]]
        got = e.rollout_log_probs[0].tolist()
        assert [got[p] for p in acts] == pytest.approx([ref[p] for p in acts], abs=ATOL)
        # OpenRLHF's reward lands on the last trained token (compute_reward, kl 0)
        shaped = compute_reward(e.rewards, 0.0, torch.zeros(1, t - 1), action_mask=e.action_mask)
        assert float(shaped[0, acts[-1]]) == pytest.approx(r["reward"])
        assert float(shaped[0].abs().sum()) == pytest.approx(abs(r["reward"]))
    # OpenRLHF's GRPO advantages (group_norm) on them: on every action token, the sample's reward
    # normalised over its Loom group
    rewards = torch.tensor([r["reward"] for r in responses]).reshape(-1, n)
    expected = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-9)).reshape(
        -1
    )
    for adv, e, want in zip(group_norm_advantages(experiences, n), experiences, expected, strict=True):
        acts = [p for p, m in enumerate(e.action_mask[0].tolist()) if m]  # the loss reads these only
        assert [float(adv[p]) for p in acts] == pytest.approx([float(want)] * len(acts), abs=1e-5)
    # the trainer's own batching (split_rollout_samples' concat, the replay buffer's split and batch)
    batch = Experience.concat_experiences(experiences, pad_token_id=0)
    width = max(len(r["observation_tokens"]) for r in responses) - 1
    assert batch.sequences.shape == (len(experiences), width + 1) and batch.action_mask.shape[1] == width
    items = split_experience_batch(batch)
    assert make_experience_batch(items).rollout_log_probs.shape == (len(experiences), width)
    # OpenRLHF's PPO loss with its rollout correction on (--algo.advantage.is_correction_level token):
    # the actor's own log-probs (teacher-forced) against Loom's behaviour ones drop no token
    rows = [teacher_forced(model, r["observation_tokens"]) for r in responses]
    actor = torch.tensor([row + [0.0] * (width - len(row)) for row in rows])
    loss_fn = PolicyLoss(is_correction_level="token")
    advantages = torch.ones_like(actor)
    _, clip_ratio, _, vllm_kl, filtered = loss_fn(
        actor, actor, advantages, action_mask=batch.action_mask, rollout_log_probs=batch.rollout_log_probs
    )
    assert float(filtered) == 0.0 and abs(float(vllm_kl)) < ATOL and float(clip_ratio) == 0.0


def group_norm_advantages(experiences: list[Any], n: int) -> list[torch.Tensor]:
    """``RemoteExperienceMaker.split_rollout_samples`` then ``compute_advantages_and_returns`` with
    ``--algo.advantage.estimator group_norm`` and no KL (what ``make_experience`` leaves: kl zeros)."""
    args = SimpleNamespace(
        train=SimpleNamespace(dynamic_batch_enable=False),
        rollout=SimpleNamespace(micro_batch_size=len(experiences), n_samples_per_prompt=n),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="group_norm", gamma=1.0, no_std_norm=False)),
        reward=SimpleNamespace(clip_range=None),
    )
    maker = SimpleNamespace(
        args=args,
        strategy=SimpleNamespace(args=args),
        tokenizer=SimpleNamespace(pad_token_id=0),
        kl_ctl=SimpleNamespace(value=0.0),
        advantage_estimator="group_norm",
    )
    maker.get_cumulative_returns = maker_methods["get_cumulative_returns"].__get__(maker)
    (batch,) = maker_methods["split_rollout_samples"](maker, experiences)
    batch.kl = torch.zeros(batch.action_mask.shape)
    (batch,) = maker_methods["compute_advantages_and_returns"](maker, [batch])
    return list(batch.advantages)


def arith(k: int, seed: int) -> list[tuple[str, Any]]:
    return [(plain_prompt(p), p.gold) for p in make_problems("arith", k, seed=seed)]


def test_plain_samples_reach_openrlhf_token_exact(stack: LoomStack, model: Any, tmp_path: Path) -> None:
    agent = agent_file(
        tmp_path, url=stack.url, api_key=TRAINER_KEY, n_samples_per_prompt=4, task="arithmetic"
    )
    items = arith(2, seed=41)
    # a prompt twice in one batch (a dataset's duplicate): two calls at once, two groups of 4
    responses, experiences = rollout(agent, [*items, items[0]], n=4, max_tokens=48)
    check_experiences(responses, experiences, model, n=4, version=0)
    assert responses[0]["prompt"] == responses[8]["prompt"]
    for r, e in zip(responses, experiences, strict=True):
        prompt_len = len(r["observation_tokens"]) - sum(e.action_mask[0].tolist())
        assert r["action_ranges"] == [(prompt_len, len(r["observation_tokens"]))]  # one span: all sampled
        assert e.rollout_log_probs[0, : prompt_len - 1].abs().sum() == 0


def test_streaming_observations_are_outside_the_action_mask(
    stack: LoomStack, model: Any, tmp_path: Path
) -> None:
    problems = make_problems("arith", 2, seed=43)
    tasks = {
        p.text: {
            "prompt": STREAM_HEADER,
            "mode_params": {"sentences": stream_sentences(p), "segment_cap": 32, "answer_max_tokens": 16},
        }
        for p in problems
    }
    agent = agent_file(
        tmp_path,
        url=stack.url,
        api_key=TRAINER_KEY,
        n_samples_per_prompt=2,
        mode="streaming",
        task="arithmetic",
        tasks=tasks,
    )
    responses, experiences = rollout(agent, [(p.text, p.gold) for p in problems], n=2, max_tokens=96)
    check_experiences(responses, experiences, model, n=2, version=0)
    tok = load_tokenizer()
    for r, e in zip(responses, experiences, strict=True):
        seq, mask = r["observation_tokens"], e.action_mask[0].tolist()
        prompt_len = len(tok.encode(STREAM_HEADER, add_special_tokens=False))
        assert tok.decode(seq[:prompt_len]) == STREAM_HEADER
        assert len(r["action_ranges"]) > 1  # the sentences cut the completion into several spans
        inserted = [seq[p + 1] for p in range(prompt_len - 1, len(seq) - 1) if not mask[p]]
        assert "number is" in tok.decode(inserted)  # the revealed sentences: never actions
        lp = e.rollout_log_probs[0].tolist()
        assert all(lp[p] == 0.0 for p in range(prompt_len - 1, len(seq) - 1) if not mask[p])


def test_tree_leaves_are_the_groups_samples(stack: LoomStack, model: Any, tmp_path: Path) -> None:
    agent = agent_file(
        tmp_path,
        url=stack.url,
        api_key=TRAINER_KEY,
        n_samples_per_prompt=4,
        mode="tree",
        mode_params=TREE,
        task="arithmetic",
    )
    responses, experiences = rollout(agent, arith(2, seed=45), n=4, max_tokens=48)
    check_experiences(responses, experiences, model, n=4, version=0)
    assert any(r["loom"]["parent_id"] is not None for r in responses), "no branch leaf reached OpenRLHF"
    by_id = {r["loom"]["trajectory_id"]: r for r in responses}
    tok = load_tokenizer()
    for r in responses:  # a branch repeats its parent's prompt and sampled prefix, token for token
        parent = by_id.get(r["loom"]["parent_id"])
        if parent is not None:
            a, b = r["observation_tokens"], parent["observation_tokens"]
            common = next(
                (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            assert common > len(tok.encode(r["prompt"], add_special_tokens=False))


def test_spawn_roots_reach_openrlhf_with_join_blocks_outside_the_mask(
    stack: LoomStack, model: Any, tmp_path: Path
) -> None:
    agent = agent_file(
        tmp_path, url=stack.url, api_key=TRAINER_KEY, n_samples_per_prompt=2, mode="spawn", task="countdown"
    )
    items = [
        (spawn_prompt(p), {"numbers": list(p.numbers), "target": p.target})  # a dict label, as a JSON dataset
        for p in make_problems("countdown", 2, seed=49)
    ]
    responses, experiences = rollout(agent, items, n=2, max_tokens=200)
    check_experiences(responses, experiences, model, n=2, version=0)
    assert all(r["loom"]["parent_id"] is None for r in responses)  # the roots; children are their own
    joined = [r for r in responses if len(r["action_ranges"]) > 1]
    assert joined, "no root joined its children"
    for r, e in zip(responses, experiences, strict=True):
        lp, mask = e.rollout_log_probs[0].tolist(), e.action_mask[0].tolist()
        start = r["action_ranges"][0][0] - 1
        assert all(lp[p] == 0.0 for p in range(start, len(mask)) if not mask[p])  # join blocks: inserted


def test_the_latest_published_version_is_asked_exactly(stack: LoomStack, model: Any, tmp_path: Path) -> None:
    agent = agent_file(
        tmp_path,
        url=stack.url,
        api_key=TRAINER_KEY,
        n_samples_per_prompt=2,
        task="arithmetic",
        policy_version="latest",
        policy_match="exact",
    )
    items = arith(1, seed=47)
    before, _ = rollout(agent, items, n=2, max_tokens=32)  # nothing published: version 0, the base
    assert {r["loom"]["policy_version"] for r in before} == {0}

    trained = load_model()
    torch.manual_seed(5)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref = PolicyPublisher(stack.url, TRAINER_KEY).publish_model(trained, load_tokenizer(), version=1)
    assert (ref.namespace, ref.version) == (TRAINER, 1)

    responses, experiences = rollout(agent, items, n=2, max_tokens=32)
    assert {(r["loom"]["policy_namespace"], r["loom"]["policy_version"]) for r in responses} == {(TRAINER, 1)}
    check_experiences(responses, experiences, trained.eval(), n=2, version=1)
    # the published weights served them, not the base model's
    e, seq = experiences[0], responses[0]["observation_tokens"]
    acts = [p for p, m in enumerate(e.action_mask[0].tolist()) if m]
    base = teacher_forced(model, seq)
    assert max(abs(e.rollout_log_probs[0, p].item() - base[p]) for p in acts) > 1e-3


def test_action_ranges_are_the_runs_of_trained_tokens() -> None:
    assert action_ranges(3, [1, 1, 0, 0, 1, 0, 1]) == [(3, 5), (7, 8), (9, 10)]
    assert action_ranges(2, [0, 0]) == [] and action_ranges(0, [1]) == [(0, 1)]
