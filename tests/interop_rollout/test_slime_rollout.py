"""slime's own rollout loop drives ``loom.clients.slime_rollout.generate`` (its
``--custom-generate-function-path``) against a live Loom deployment (LoomStack: embedded broker,
real rollout and reward workers on the tiny model, the gateway), in plain, streaming and tree mode,
and at a policy version the trainer names.

slime is not on PyPI. Replayed from THUDM/slime at 624b824a898ab0ec1fcb4d373004c7f3852bf515 (the
code is rewritten here from reading it, keeping what each step does and checks):
- ``Sample`` (``slime/utils/types.py`` 93-151: the fields the rollout and the conversion read, the
  ``Status`` enum; ``get_reward_value`` 246-247; the length checks of
  ``_validate_response_metadata_lengths`` 418-425);
- the groups (``slime/rollout/data_source.py`` 108-117: ``n_samples_per_prompt`` deep copies of a
  prompt sample, one ``group_index``, consecutive ``index``);
- the sampling params (``slime/rollout/sglang_rollout.py`` 95-105, ``GenerateState``);
- ``generate_and_rm`` (sglang_rollout.py 225-289: the custom function loaded by path, called with
  ``evaluation`` when its signature has it, the reward model skipped where the reward is filled) and
  ``generate_and_rm_group`` (297-336: a session id each, one task per sample, ``asyncio.gather``);
- ``generate_rollout_async`` (425: a group has ``n_samples_per_prompt`` samples; 454: sorted by
  index), ``validate_rollout_id_annotated`` (``slime/observability/rollout_data_utils.py`` 92-) and the
  flattening (``slime/ray/rollout.py`` 601-605);
- ``RolloutManager._post_process_rewards`` (rollout.py 608-633, GRPO group norm) and
  ``_convert_samples_to_train_data`` (635-716: its asserts on rewards, loss masks and lengths, the
  per-rollout mask sums, ``rollout_log_probs``).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import inspect
import itertools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from loom.answers import last_boxed
from loom.clients.policies import PolicyPublisher
from loom.clients.slime_rollout import LoomGenerate, from_args
from tests.interop_rollout.loom_stack import TRAINER, TRAINER_KEY, LoomStack
from tests.interop_rollout.test_client import teacher_forced
from zoo.tiny import STREAM_HEADER, load_model, load_tokenizer, make_problems, plain_prompt, spawn_prompt
from zoo.tiny.traces import stream_sentences

pytestmark = pytest.mark.slow

ATOL = 1e-4
TREE = {"strategy": "random", "branches": 1, "continuations": 2, "min_distance": 4, "expansion": "all"}


# ---- slime, replayed (module docstring)


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    session_id: str | None = None

    def get_reward_value(self, args: Any) -> Any:
        return self.reward if not args.reward_key else self.reward[args.reward_key]  # type: ignore[index]

    def validate_lengths(self) -> None:
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(
                f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}"
            )
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError("rollout_log_probs length != response_length")


def slime_args(n: int, **loom: Any) -> SimpleNamespace:
    """slime's defaults for what the rollout path reads, the custom function's path, and the Loom
    keys ``--custom-config-path`` would set."""
    return SimpleNamespace(
        custom_generate_function_path="loom.clients.slime_rollout.generate",
        n_samples_per_prompt=n,
        rollout_batch_size=None,
        rollout_temperature=1.0,
        rollout_top_p=1.0,
        rollout_top_k=-1,
        rollout_max_response_len=64,
        rollout_stop=None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        partial_rollout=False,
        mask_offpolicy_in_partial_rollout=False,
        group_rm=False,
        reward_key=None,
        advantage_estimator="grpo",
        rewards_normalization=True,
        grpo_std_normalization=True,
        **{f"loom_{k}": v for k, v in loom.items()},
    )


def data_source(args: Any, prompt_samples: list[Sample]) -> list[list[Sample]]:
    groups, index = [], 0
    for group_index, prompt_sample in enumerate(prompt_samples):
        group = []
        for _ in range(args.n_samples_per_prompt):
            sample = copy.deepcopy(prompt_sample)
            sample.group_index, sample.index = group_index, index
            index += 1
            group.append(sample)
        groups.append(group)
    return groups


def sampling_params(args: Any) -> dict[str, Any]:
    return dict(
        temperature=args.rollout_temperature,
        top_p=args.rollout_top_p,
        top_k=args.rollout_top_k,
        max_new_tokens=args.rollout_max_response_len,
        stop=args.rollout_stop,
        stop_token_ids=args.rollout_stop_token_ids,
        skip_special_tokens=args.rollout_skip_special_tokens,
        no_stop_trim=True,
        spaces_between_special_tokens=False,
    )


def load_function(path: str) -> Any:
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


async def generate_and_rm(args: Any, sample: Sample, params: dict[str, Any], evaluation: bool = False) -> Any:
    if args.partial_rollout and args.mask_offpolicy_in_partial_rollout and sample.response_length > 0:
        sample.loss_mask = [0] * sample.response_length
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    func = load_function(sample.generate_function_path or args.custom_generate_function_path)
    if "evaluation" in inspect.signature(func).parameters:
        sample = await func(args, sample, params, evaluation=evaluation)
    else:
        sample = await func(args, sample, params)
    if args.group_rm or sample.status == Sample.Status.ABORTED:
        return sample
    assert sample.reward is not None, "Loom's reward fills it: slime's reward model is not called"
    return sample


async def generate_and_rm_group(args: Any, group: list[Sample], params: dict[str, Any]) -> list[Sample]:
    for sample in group:
        if sample.session_id is None:
            sample.session_id = str(uuid.uuid4())
    tasks = [asyncio.create_task(generate_and_rm(args, s, params.copy())) for s in group]
    return list(await asyncio.gather(*tasks))


async def generate_rollout(args: Any, groups: list[list[Sample]]) -> list[list[Sample]]:
    params = sampling_params(args)
    done = await asyncio.gather(*(generate_and_rm_group(args, g, params) for g in groups))
    for group in done:
        assert len(group) == args.n_samples_per_prompt
    return sorted(done, key=lambda group: group[0].index)  # type: ignore[arg-type,return-value]


def validate_rollout_id_annotated(node: Any, depth: int = 0) -> None:
    if isinstance(node, Sample):
        return
    assert isinstance(node, list)
    if node and isinstance(node[0], Sample):
        if depth >= 2 and len(node) > 1:
            rids = [s.rollout_id for s in node]
            assert None not in rids and len(set(rids)) == 1
        return
    for item in node:
        validate_rollout_id_annotated(item, depth + 1)


def convert_samples_to_train_data(args: Any, samples: list[Sample]) -> dict[str, Any]:
    raw_rewards = [s.get_reward_value(args) for s in samples]
    rewards = torch.tensor(raw_rewards, dtype=torch.float)
    rewards = rewards.reshape(-1, args.n_samples_per_prompt)
    rewards = rewards - rewards.mean(dim=-1, keepdim=True)
    rewards = rewards / (rewards.std(dim=-1, keepdim=True) + 1e-6)
    normed = rewards.flatten().tolist()
    assert len(raw_rewards) == len(samples) and len(normed) == len(samples)
    rollout_ids = [s.rollout_id if s.rollout_id is not None else i for i, s in enumerate(samples)]
    train: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": normed,
        "raw_reward": raw_rewards,
        "truncated": [1 if s.status == Sample.Status.TRUNCATED else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": rollout_ids,
    }
    for s in samples:
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        assert len(s.loss_mask) == s.response_length
    train["loss_masks"] = [s.loss_mask for s in samples]
    totals: dict[int, int] = {}
    for rid, m in zip(rollout_ids, train["loss_masks"], strict=True):
        totals[rid] = totals.get(rid, 0) + sum(m)
    train["rollout_mask_sums"] = [totals[rid] for rid in rollout_ids]
    if samples[0].rollout_log_probs is not None:
        train["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    return train


def run_slime(args: Any, prompt_samples: list[Sample]) -> tuple[list[list[Sample]], dict[str, Any]]:
    groups = asyncio.run(generate_rollout(args, data_source(args, prompt_samples)))
    validate_rollout_id_annotated(groups)
    flat = list(itertools.chain.from_iterable(groups))
    return groups, convert_samples_to_train_data(args, flat)


# ---- the tests


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomStack]:
    with LoomStack(tmp_path_factory.mktemp("slime-rollouts")) as s:
        yield s


@pytest.fixture(scope="module")
def model() -> Any:
    torch.set_num_threads(1)
    return load_model().eval()


def arith_samples(k: int, seed: int) -> list[Sample]:
    return [Sample(prompt=plain_prompt(p), label=p.gold) for p in make_problems("arith", k, seed=seed)]


def stream_samples(k: int) -> list[Sample]:
    # the dataset row's metadata (slime's --metadata-key) carries the Loom task: its sentences
    return [
        Sample(
            prompt=STREAM_HEADER,
            label=p.gold,
            metadata={
                "loom": {
                    "mode_params": {
                        "sentences": stream_sentences(p),
                        "segment_cap": 32,
                        "answer_max_tokens": 16,
                    }
                }
            },
        )
        for p in make_problems("arith", k, seed=1)
    ]


def spawn_samples(k: int) -> list[Sample]:
    # a Countdown label as slime's data holds it (a dict): Loom's job reads its JSON text
    return [
        Sample(
            prompt=spawn_prompt(p),
            label={"numbers": list(p.numbers), "target": p.target},  # type: ignore[arg-type]
            metadata={"loom": {"task": "countdown"}},
        )
        for p in make_problems("countdown", k, seed=3)
    ]


CASES: dict[str, tuple[Any, dict[str, Any], int]] = {
    "plain": (lambda: arith_samples(2, seed=41), {}, 64),
    "streaming": (lambda: stream_samples(2), {}, 96),
    "tree": (lambda: arith_samples(2, seed=43), TREE, 64),
    "spawn": (lambda: spawn_samples(2), {}, 200),
}


def check_samples(groups: list[list[Sample]], train: dict[str, Any], model: Any, n: int) -> None:
    tok = load_tokenizer()
    flat = [s for g in groups for s in g]
    assert [s.index for s in flat] == list(range(len(flat)))
    for g in groups:
        # one Loom group per slime group: its samples share the group id and the prompt
        assert len({s.metadata["loom_group_id"] for s in g}) == 1
        assert len({s.metadata["loom_trajectory_id"] for s in g}) == n
    for s, tokens, length, mask, logp in zip(
        flat,
        train["tokens"],
        train["response_lengths"],
        train["loss_masks"],
        train["rollout_log_probs"],
        strict=True,
    ):
        s.validate_lengths()
        if s.metadata["loom_rollout_status"] == "format_error":  # spawn: the policy's malformed block
            assert s.status == Sample.Status.FAILED
        else:
            assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        prompt_ids = tokens[: len(tokens) - length]
        completion = tokens[len(tokens) - length :]
        assert prompt_ids == tok.encode(s.prompt, add_special_tokens=False)
        assert length > 0 and len(mask) == length == len(logp)
        # the reward is the job's on this very sample: 1 exactly where its boxed answer is the gold
        total = s.reward["reward"] if isinstance(s.reward, dict) else s.reward
        if isinstance(s.label, str):  # arithmetic: 1 exactly where the boxed answer is the gold
            assert total == float(last_boxed(s.response) == s.label)
        # behaviour log-probs equal a teacher-forced pass of the served weights on every sampled token
        env = s.metadata["loom_env_mask"]
        ref = teacher_forced(model, prompt_ids, completion)
        sampled = [j for j in range(length) if env[j]]
        assert [logp[j] for j in sampled] == pytest.approx([ref[j] for j in sampled], abs=ATOL)
        # inserted tokens: no behaviour log-prob and out of slime's loss
        assert all(logp[j] == 0.0 and mask[j] == 0 for j in range(length) if not env[j])
        assert s.metadata["loom_components"]["accuracy"] == total
    # what slime trains on (get_reward_value: the total, or the --reward-key component) is the job's reward
    assert train["raw_reward"] == [s.metadata["loom_components"]["accuracy"] for s in flat]


@pytest.mark.parametrize("mode", list(CASES))
def test_slime_rollout_loop_fills_token_exact_samples(stack: LoomStack, model: Any, mode: str) -> None:
    make, params, max_len = CASES[mode]
    n = 2
    args = slime_args(
        n, url=stack.url, api_key=TRAINER_KEY, mode=mode, mode_params=params or None, task="arithmetic"
    )
    args.rollout_max_response_len = max_len
    groups, train = run_slime(args, make())
    check_samples(groups, train, model, n)
    flat = [s for g in groups for s in g]
    assert from_args(args).jobs == len(groups)  # the n calls of a group shared one job
    assert all(s.metadata["loom_policy_version"] == 0 and s.weight_versions == ["0"] for s in flat)
    if mode == "plain":
        assert all(all(s.loss_mask or []) and s.metadata["loom_advantages"] is None for s in flat)
    if mode == "streaming":
        tok = load_tokenizer()
        for s in flat:
            mask = s.loss_mask or []
            assert 0 in mask and 1 in mask  # the sentences arrived inside the response, masked out
            completion = s.tokens[len(s.tokens) - s.response_length :]
            inserted = tok.decode([t for t, m in zip(completion, mask, strict=True) if not m])
            assert "number is" in inserted
    if mode == "spawn":  # the roots; their children's results joined in as inserted tokens
        assert all(s.metadata["loom_parent_id"] is None for s in flat)  # no child thread
        assert any(0 in (s.loss_mask or []) for s in flat), "no parent joined its children"
    if mode == "tree":
        assert any(s.metadata["loom_parent_id"] for s in flat), "no branch leaf reached slime"
        for s in flat:  # TreeRL's node advantages ride along in the metadata, one per response token
            assert len(s.metadata["loom_advantages"]) == s.response_length


def test_a_spawn_format_error_reaches_slime_as_failed_with_its_reward(stack: LoomStack, model: Any) -> None:
    # max_depth 0: the root may not spawn, so each root's first spawn block is the policy's format error
    n = 2
    args = slime_args(
        n, url=stack.url, api_key=TRAINER_KEY, mode="spawn", mode_params={"max_depth": 0}, task="arithmetic"
    )
    args.rollout_max_response_len = 200
    groups, train = run_slime(args, spawn_samples(2))
    check_samples(groups, train, model, n)  # FAILED exactly where the rollout ended in a format error
    flat = [s for g in groups for s in g]
    failed = [s for s in flat if s.status == Sample.Status.FAILED]
    assert failed, "no root spawned: the case needs the tiny model's spawn habit"
    for s in failed:  # no join: the rollout stopped at the block, and the job's reward stands
        assert s.metadata["loom_rollout_status"] == "format_error"
        assert all(s.loss_mask or [None]) and s.reward is not None
    assert not any(s.status == Sample.Status.ABORTED for s in flat)  # slime would generate these again


def test_the_trainer_names_the_exact_policy_version(stack: LoomStack, model: Any) -> None:
    torch.manual_seed(5)
    trained = load_model().eval()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref = PolicyPublisher(stack.url, TRAINER_KEY).publish_model(trained, load_tokenizer(), version=1)
    assert (ref.namespace, ref.version) == (TRAINER, 1)
    args = slime_args(
        2,
        url=stack.url,
        api_key=TRAINER_KEY,
        task="arithmetic",
        policy_version=1,
        policy_namespace=TRAINER,
        policy_match="exact",
    )
    args.reward_key = "accuracy"  # --reward-key: the reward is a dict, the key picks the component
    groups, train = run_slime(args, arith_samples(1, seed=47))
    check_samples(groups, train, trained, 2)
    flat = [s for g in groups for s in g]
    assert all(s.metadata["loom_policy_version"] == 1 and s.weight_versions == ["1"] for s in flat)
    assert all(s.metadata["loom_policy_namespace"] == TRAINER for s in flat)
    assert all(isinstance(s.reward, dict) and s.reward["reward"] == s.reward["accuracy"] for s in flat)
    # the base model's log-probs are not these: the version mattered
    s = flat[0]
    prompt_ids, completion = s.tokens[: -s.response_length], s.tokens[-s.response_length :]
    assert teacher_forced(model, prompt_ids, completion) != pytest.approx(s.rollout_log_probs, abs=ATOL)


def test_bad_settings_fail_before_any_job() -> None:
    with pytest.raises(Exception, match="does not know mode_params"):
        LoomGenerate("http://127.0.0.1:9", mode="tree", mode_params={"bogus": 1})
    with pytest.raises(ValueError, match="group_positions"):
        LoomGenerate("http://127.0.0.1:9", mode="streaming", mode_params={"layout": "group_positions"})
    gen = LoomGenerate("http://127.0.0.1:9")
    args = slime_args(2)
    partial = Sample(prompt="x", response_length=3, group_index=0)
    with pytest.raises(ValueError, match="partial rollout"):
        asyncio.run(gen(args, partial, sampling_params(args)))
    top_p = dict(sampling_params(args), custom_params={"return_top_p_token_ids": True})
    with pytest.raises(ValueError, match="top-p replay"):
        asyncio.run(gen(args, Sample(prompt="x", group_index=0), top_p))
