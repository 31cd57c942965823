"""TRL 1.16's own ``GRPOTrainer`` trains Loom's tiny model on CPU with every rollout from Loom
(``rollout_func=LoomRolloutFunc(...)``, loom/clients/trl_rollout.py) against a live deployment: tree
mode (3 steps) and streaming mode (2 steps). The trainer publishes its weights as a new policy version
each step that trained, through the gateway's policy routes into its key's namespace
(``PolicyPublisher``); every trajectory records the step it was generated for (namespace and version),
and its behaviour log-probs are those of the weights published for that step."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from loom.answers import last_boxed
from loom.clients.policies import PolicyPublisher
from loom.clients.rollouts import RolloutGroup
from loom.clients.trl_rollout import (
    LoomRolloutFunc,
    job_reward,
    off_policy_calls,
    publish_with,
    trl_logprobs,
)
from loom.contracts.wire import Group
from loom.store import PolicyStore
from tests.interop_rollout.loom_stack import TRAINER, TRAINER_KEY, LoomStack
from zoo.tiny import STREAM_HEADER, load_model, load_tokenizer, make_problems, plain_prompt
from zoo.tiny.traces import stream_sentences

pytestmark = pytest.mark.slow

TREE = {"strategy": "random", "branches": 1, "continuations": 2, "min_distance": 4}


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomStack]:
    """One deployment per run: its policy store starts empty (version 0, the tiny model)."""
    with LoomStack(tmp_path_factory.mktemp("trl-rollouts")) as s:
        yield s


def _trainer(
    tmp_path: Path, rollout: Any, dataset: Dataset, steps: int, temperature: float = 1.0
) -> GRPOTrainer:
    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=8,
        num_generations=4,  # two prompts' groups of 4 per step
        max_completion_length=64,
        temperature=temperature,
        learning_rate=5e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )
    return GRPOTrainer(
        model=load_model(),
        reward_funcs=[job_reward],
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(),
        rollout_func=rollout,
    )


class Recorded:
    """The rollout function, keeping what it returned to TRL at each call."""

    def __init__(self, inner: LoomRolloutFunc) -> None:
        self.inner, self.outputs = inner, []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = self.inner(prompts, trainer)
        self.outputs.append(out)
        return out


def teacher_forced(
    model: Any, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
) -> list[float]:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    return [float(logp[len(prompt_ids) + j - 1, t]) for j, t in enumerate(completion_ids)]


def check_versions_and_logprobs(rec: Recorded, stack: LoomStack, steps: int) -> None:
    history = rec.inner.history
    assert [h["step"] for h in history] == list(range(steps))
    assert off_policy_calls(history, staleness=0) == []
    assert [h["version"] for h in history] == list(range(steps))  # 0: the base model
    for out in rec.outputs[1:]:  # the trainer's versions live in its key's namespace
        assert set(out["loom_policy_namespace"]) == {TRAINER}
    store = PolicyStore(stack.policy_root / "ns" / TRAINER)
    assert store.versions() == list(range(1, steps))
    assert PolicyStore(stack.policy_root).versions() == []  # nothing in the learner's own
    # each call's behaviour log-probs are those of the weights published for its step
    for step, out in enumerate(rec.outputs):
        model = load_model(None if step == 0 else store.path_of(step)).eval()
        for i in (0, len(out["completion_ids"]) - 1):
            ids, mask = out["completion_ids"][i], out["env_mask"][i]
            ref = teacher_forced(model, out["prompt_ids"][i], ids)
            trained = [j for j, m in enumerate(mask) if m]
            got = [out["logprobs"][i][j] for j in trained]
            assert got == pytest.approx([ref[j] for j in trained], abs=1e-4), f"step {step} sample {i}"


def test_grpo_trainer_trains_on_loom_tree_rollouts_publishing_each_step(
    stack: LoomStack, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    problems = make_problems("arith", 6, seed=21)
    dataset = Dataset.from_list([{"prompt": plain_prompt(p), "answer": p.gold} for p in problems])
    tasks = {plain_prompt(p): {"label": p.gold, "task": "arithmetic"} for p in problems}
    rollout = LoomRolloutFunc(
        stack.url,
        TRAINER_KEY,
        mode="tree",
        mode_params=TREE,
        tasks=tasks,
        publish=publish_with(PolicyPublisher(stack.url, TRAINER_KEY), load_tokenizer()),
    )
    rec = Recorded(rollout)
    trainer = _trainer(tmp_path, rec, dataset, steps=3)
    trainer.train()

    assert trainer.state.global_step == 3 and len(rec.outputs) == 3
    check_versions_and_logprobs(rec, stack, 3)
    logged = [h for h in trainer.state.log_history if "rewards/job_reward/mean" in h]
    assert len(logged) == 3
    for out, h in zip(rec.outputs, logged, strict=True):
        assert len(out["completion_ids"]) == 8  # 2 prompts x num_generations, whatever the trees grew
        # TRL trains on the rewards Loom's job gave
        assert h["rewards/job_reward/mean"] == pytest.approx(sum(out["loom_reward"]) / 8, abs=1e-6)
        assert all(len(m) == len(c) for m, c in zip(out["env_mask"], out["completion_ids"], strict=True))
        groups = [out["loom_group_id"][k] for k in range(0, 8, 4)]
        assert all(out["loom_group_id"][k] == groups[k // 4] for k in range(8))
    # each reward TRL got belongs to the completion beside it: 1 exactly where its boxed answer is the gold
    tok = load_tokenizer()
    gold = {plain_prompt(p): p.gold for p in problems}
    for out in rec.outputs:
        for prompt_ids, ids, reward in zip(
            out["prompt_ids"], out["completion_ids"], out["loom_reward"], strict=True
        ):
            answer = last_boxed(tok.decode(ids, skip_special_tokens=True))
            assert reward == float(answer == gold[tok.decode(prompt_ids)]), (answer, reward)
    assert len({t for out in rec.outputs for t in out["loom_trajectory_id"]}) == 24
    branched = [t for out in rec.outputs for t in out["loom_trajectory_id"] if ".b" in t]
    assert branched, "no branch leaf reached TRL"


def test_grpo_trainer_trains_on_loom_streaming_rollouts(stack: LoomStack, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    problems = make_problems("arith", 4, seed=31)
    # the dataset's prompt is the problem's text (one per problem); Loom streams its sentences
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.gold} for p in problems])
    tasks = {
        p.text: {
            "prompt": STREAM_HEADER,
            "label": p.gold,
            "task": "arithmetic",
            "mode_params": {"sentences": stream_sentences(p), "segment_cap": 32, "answer_max_tokens": 16},
        }
        for p in problems
    }
    rollout = LoomRolloutFunc(
        stack.url,
        TRAINER_KEY,
        mode="streaming",
        tasks=tasks,
        publish=publish_with(PolicyPublisher(stack.url, TRAINER_KEY), load_tokenizer()),
    )
    rec = Recorded(rollout)
    trainer = _trainer(tmp_path, rec, dataset, steps=2)
    trainer.train()

    assert trainer.state.global_step == 2 and len(rec.outputs) == 2
    check_versions_and_logprobs(rec, stack, 2)
    tok = load_tokenizer()
    for out in rec.outputs:
        for prompt_ids, ids, mask in zip(
            out["prompt_ids"], out["completion_ids"], out["env_mask"], strict=True
        ):
            assert tok.decode(prompt_ids) == STREAM_HEADER
            assert 0 in mask and 1 in mask  # the sentences are observations, never trained
            inserted = tok.decode([t for t, m in zip(ids, mask, strict=True) if not m])
            assert "number is" in inserted


def test_trl_logprobs_are_the_tempered_distributions_or_none() -> None:
    """TRL compares the behaviour log-probs with its own, of the logits divided by its temperature:
    raw ones of a tempered sampling are another distribution's and reach TRL as None (NaN there: no
    importance correction) instead of a gap of several nats."""
    from loom.contracts.wire import LogprobsProcessing, Trajectory

    def sample(kind: str, processing: float | None) -> Any:
        t = Trajectory(
            id="t",
            group_id="g",
            completion_ids=[5, 6],
            logprobs=[-0.5, -1.5],
            logprobs_kind=kind,  # type: ignore[arg-type]
            logprobs_processing=None if processing is None else LogprobsProcessing(temperature=processing),
        )
        group = Group(id="g", trajectories=[t.model_dump(mode="json")])
        return RolloutGroup.from_event({"index": 0, "group": group, "rewards": None}).samples[0]

    assert trl_logprobs(sample("raw", None), 1.0) == [-0.5, -1.5]
    assert trl_logprobs(sample("raw", None), 1.3) == [None, None]
    assert trl_logprobs(sample("processed", 1.3), 1.3) == [-0.5, -1.5]
    assert trl_logprobs(sample("processed", 1.0), 1.3) == [None, None]
    assert trl_logprobs(sample("processed", None), 1.3) == [None, None]  # processing unknown


@pytest.fixture
def processed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomStack]:
    """A deployment whose engine reports the tempered (processed) log-probs."""
    env = {"LOOM_ENGINE_LOGPROBS_MODE": "processed"}
    with LoomStack(tmp_path_factory.mktemp("trl-processed"), extra_env=env) as s:
        yield s


def test_trl_gets_the_log_probs_of_its_temperature(processed_stack: LoomStack, tmp_path: Path) -> None:
    """At temperature 1.3 the log-probs TRL gets equal the ones it recomputes (its logits / 1.3) on
    every trained token, where the deployment reports processed log-probs."""
    torch.set_num_threads(1)
    problems = make_problems("arith", 2, seed=41)
    dataset = Dataset.from_list([{"prompt": plain_prompt(p), "answer": p.gold} for p in problems])
    tasks = {plain_prompt(p): {"label": p.gold, "task": "arithmetic"} for p in problems}
    rollout = LoomRolloutFunc(processed_stack.url, TRAINER_KEY, mode="tree", mode_params=TREE, tasks=tasks)
    rec = Recorded(rollout)
    _trainer(tmp_path, rec, dataset, steps=1, temperature=1.3).train()

    (out,) = rec.outputs
    model = load_model().eval()
    for i in range(len(out["completion_ids"])):
        ids, mask, got = out["completion_ids"][i], out["env_mask"][i], out["logprobs"][i]
        ref = teacher_forced(model, out["prompt_ids"][i], ids, temperature=1.3)
        trained = [j for j, m in enumerate(mask) if m]
        assert [got[j] for j in trained] == pytest.approx([ref[j] for j in trained], abs=1e-4), i
