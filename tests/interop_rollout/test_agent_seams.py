"""Loom's agent mode at TRL's, OpenRLHF's and slime's multi-turn seams (docs/interop-rollout.md, "Agent
mode at each trainer's seam"; verl's is tests/interop_rollout/test_verl_agent_seam.py), each driven by
the trainer's own code as the single-turn tests drive it: TRL 1.16's ``GRPOTrainer`` trains one step on
``LoomRolloutFunc(mode="agent")``; OpenRLHF 0.11.2's ``_load_agent_executor``,
``RolloutRayActor.generate_responses`` and ``_process_response_into_experience`` (compiled from the
installed files, test_openrlhf_rollout.py) run ``LoomAgentExecutor``; slime's rollout loop (replayed,
test_slime_rollout.py) runs ``loom.clients.slime_rollout.generate``.

The deployment serves tests/interop_rollout/agent_model.py's checkpoint (the built-in models call no
tool): its episodes are Loom's real agent mode on the real torch engine, a policy turn that calls the
calculator, its observation, and a turn after it. Each row is checked against Loom's stored trajectory
and a teacher-forced pass of those weights (tests/interop_rollout/agent_checks.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from loom.clients.openrlhf_rollout import action_ranges
from loom.clients.trainer_rows import follow_window, loom_tools
from loom.clients.trl_rollout import LoomRolloutFunc, job_reward
from loom.contracts.modes import AgentParams
from tests.interop_rollout.agent_checks import AGENT, LABEL, PROMPTS, check_episode, loom_trajectory
from tests.interop_rollout.agent_model import build_agent_model
from tests.interop_rollout.loom_stack import TRAINER_KEY, LoomStack
from tests.interop_rollout.test_openrlhf_rollout import (
    agent_file,
    generate_responses,
    load_agent_executor,
    process_response,
    sampling_params,
)
from tests.interop_rollout.test_slime_rollout import Sample, run_slime, slime_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_LEN = 256  # OpenRLHF's max_length: the episode's budget is what its prompt leaves of it


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent_model(tmp_path_factory.mktemp("agent-model") / "ckpt")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> Iterator[LoomStack]:
    with LoomStack(tmp_path_factory.mktemp("agent-seams"), extra_env={"LOOM_MODEL": str(checkpoint)}) as s:
        yield s


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> Any:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(checkpoint).eval()


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> Any:
    return AutoTokenizer.from_pretrained(checkpoint)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. 2+3.

    Returns:
        Its value.
    """
    raise AssertionError("Loom runs its own calculator; TRL never calls this one")


# ---- TRL


def test_trl_rollout_func_carries_the_agent_episodes_env_mask(
    stack: LoomStack, checkpoint: Path, model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    tasks = {p: {"label": LABEL, "task": "arithmetic"} for p in PROMPTS}
    params = {k: v for k, v in AGENT.items() if k != "tools"}  # the tools come as TRL's functions
    rollout = LoomRolloutFunc(
        stack.url,
        TRAINER_KEY,
        mode="agent",
        mode_params=params,
        tools=[calculator],
        tasks=tasks,
        sampling={"seed": 7},  # the episodes are the engine's samples; seeded, the same each run
    )
    outputs: list[dict[str, list[Any]]] = []

    def recorded(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        outputs.append(rollout(prompts, trainer))
        return outputs[-1]

    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        max_steps=1,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=48,
        temperature=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(checkpoint),
        reward_funcs=[job_reward],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=tokenizer,
        rollout_func=recorded,
    )
    trainer.train()
    (out,) = outputs
    assert len(out["completion_ids"]) == 8
    observed = 0
    for i in range(8):
        t = loom_trajectory(stack.url, TRAINER_KEY, out["loom_group_id"][i], out["loom_trajectory_id"][i])
        got = check_episode(
            t,
            tokenizer,
            model,
            out["prompt_ids"][i],
            out["completion_ids"][i],
            out["env_mask"][i],  # TRL multiplies it into its loss mask
            out["logprobs"][i],
        )
        assert out["loom_tool_calls"][i] == got and out["loom_stop_reason"][i] == t.stop_reason
        observed += got
        # the window followed the trainer: max_completion_length bounds the whole episode
        assert len(out["completion_ids"][i]) <= args.max_completion_length
    assert observed > 0, "no episode called the calculator"


def test_trl_tools_are_loom_built_ins_or_refused() -> None:
    assert loom_tools([calculator, "countdown_check"], "TRL") == ["calculator", "countdown_check"]

    def shell(command: str) -> str:
        """Run a command."""
        return command

    with pytest.raises(ValueError, match=r"TRL's tools \['shell'\] are not Loom's built-in tools"):
        LoomRolloutFunc("http://127.0.0.1:9", mode="agent", tools=[shell])
    with pytest.raises(ValueError, match="agent mode's"):
        LoomRolloutFunc("http://127.0.0.1:9", mode="plain", tools=[calculator])
    # the episode's budget follows the trainer's window unless the configuration names one
    assert follow_window("agent", {"max_turns": 2}, 48) == {"max_turns": 2, "max_total_tokens": 48}
    assert follow_window("agent", {"max_total_tokens": 20}, 48) == {"max_total_tokens": 20}
    typed = follow_window("agent", AgentParams(max_turns=2), 48)
    assert isinstance(typed, AgentParams) and typed.max_total_tokens == 48
    assert follow_window("plain", {}, 48) == {}


# ---- OpenRLHF


def test_openrlhf_experience_masks_the_observations_and_keeps_the_turns(
    stack: LoomStack, model: Any, tokenizer: Any, tmp_path: Path
) -> None:
    n = 2
    agent = agent_file(
        tmp_path,
        url=stack.url,
        api_key=TRAINER_KEY,
        n_samples_per_prompt=n,
        mode="agent",
        mode_params=AGENT,
        task="arithmetic",
        sampling={"seed": 7},
    )
    actor = SimpleNamespace(executor=load_agent_executor(str(agent)))  # RolloutRayActor's one attribute read

    async def main() -> list[list[dict[str, Any]]]:
        calls = [
            generate_responses(
                actor,
                prompt=p,
                label=LABEL,
                sampling_params=sampling_params(32),
                max_length=MAX_LEN,
                hf_tokenizer=tokenizer,
                num_samples=n,
            )
            for p in PROMPTS
        ]
        return list(await asyncio.gather(*calls))

    responses = [r for per_prompt in asyncio.run(main()) for r in per_prompt]
    observed = 0
    for r in responses:
        e = process_response(None, r, max_len=MAX_LEN)
        t = loom_trajectory(stack.url, TRAINER_KEY, r["loom"]["group_id"], r["loom"]["trajectory_id"])
        seq, p = r["observation_tokens"], len(t.prompt_ids)
        assert e.sequences[0].tolist() == seq
        # OpenRLHF's position q scores seq[q + 1]: completion token j sits at q = p - 1 + j
        mask = e.action_mask[0].tolist()[p - 1 :]
        logp = e.rollout_log_probs[0].tolist()[p - 1 :]
        assert not any(e.action_mask[0].tolist()[: p - 1])
        got = check_episode(t, tokenizer, model, seq[:p], seq[p:], mask, logp)
        observed += got
        # MultiTurnAgentExecutor's layout: one action range per policy turn, in prompt + completion offsets
        turns = [(p + s.start, p + s.end) for s in t.segments if s.kind == "turn"]
        assert r["action_ranges"] == turns == action_ranges(p, t.loss_mask or [])
        assert r["loom"]["turn_spans"] == [(s - p, x - p) for s, x in turns]
        assert e.info["loom_tool_calls"].tolist() == [float(got)]
        assert e.info["loom_turns"].tolist() == [float(len(turns))]
        assert len(seq) - p <= MAX_LEN - p  # the episode fit max_length
    assert observed > 0, "no episode called the calculator"


# ---- slime


def test_slime_samples_carry_the_multi_turn_loss_mask_and_log_probs(
    stack: LoomStack, model: Any, tokenizer: Any
) -> None:
    n = 2
    args = slime_args(
        n,
        url=stack.url,
        api_key=TRAINER_KEY,
        mode="agent",
        mode_params=AGENT,
        task="arithmetic",
        sampling={"seed": 7},
    )
    args.rollout_max_response_len = 40
    groups, train = run_slime(args, [Sample(prompt=p, label=LABEL) for p in PROMPTS])
    flat = [s for g in groups for s in g]
    observed = 0
    for s, tokens, length, mask, logp in zip(
        flat,
        train["tokens"],
        train["response_lengths"],
        train["loss_masks"],
        train["rollout_log_probs"],
        strict=True,
    ):
        s.validate_lengths()
        m = s.metadata
        t = loom_trajectory(stack.url, TRAINER_KEY, m["loom_group_id"], m["loom_trajectory_id"])
        p = len(tokens) - length
        got = check_episode(t, tokenizer, model, tokens[:p], tokens[p:], mask, logp)
        observed += got
        assert m["loom_tool_calls"] == got and m["loom_stop_reason"] == t.stop_reason
        assert m["loom_observation_spans"] == [
            (x.start, x.end) for x in t.segments if x.kind == "observation"
        ]
        assert s.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED)
        assert length <= args.rollout_max_response_len  # the episode fit slime's response budget
    # slime's per-rollout mask sums count the policy tokens only
    assert train["rollout_mask_sums"] == [sum(x) for x in train["loss_masks"]]
    assert observed > 0, "no episode called the calculator"


def test_an_episodes_turns_and_tool_calls_are_its_agent_segments_only() -> None:
    """``episode_of``: an agent episode's turns and observations; another mode's observation
    segments (streaming's sentences, spawn's join blocks) are no tool call, and its sample one turn."""
    from loom.clients.rollouts import RolloutGroup
    from loom.clients.trainer_rows import episode_of
    from loom.contracts.wire import Group, Segment, Trajectory

    def sample(segments: list[Segment], stop: str | None) -> Any:
        t = Trajectory(
            id="t",
            group_id="g",
            completion_ids=list(range(9)),
            logprobs=[0.0] * 9,
            segments=segments,
            stop_reason=stop,
        )
        group = Group(id="g", trajectories=[t.model_dump(mode="json")])
        return RolloutGroup.from_event({"index": 0, "group": group, "rewards": None}).samples[0]

    agent = sample(
        [
            Segment(kind="turn", start=0, end=3),
            Segment(kind="observation", start=3, end=5),
            Segment(kind="turn", start=5, end=9, index=1),
        ],
        "no_tool_call",
    )
    assert episode_of(agent) == {
        "turns": 2,
        "tool_calls": 1,
        "env_steps": 0,
        "responses": 1,
        "turn_spans": [(0, 3), (5, 9)],
        "observation_spans": [(3, 5)],
        "stop_reason": "no_tool_call",
    }
    # an environment's episode: a reset observation, two steps (the last done, unanswered), none a tool
    env = sample(
        [
            Segment(kind="observation", start=0, end=2, meta={"env": "countdown"}),
            Segment(kind="turn", start=2, end=4, meta={"env_status": "ok"}),
            Segment(kind="observation", start=4, end=6, index=0, meta={"env": "countdown"}),
            Segment(kind="turn", start=6, end=9, index=1, meta={"env_status": "ok"}),
        ],
        "env_done",
    )
    got = episode_of(env)
    assert (got["turns"], got["env_steps"], got["tool_calls"], got["responses"]) == (2, 2, 0, 2)
    streaming = sample(
        [Segment(kind="observation", start=0, end=4), Segment(kind="stream", start=4, end=9)], None
    )
    assert episode_of(streaming)["turns"] == 1 and episode_of(streaming)["tool_calls"] == 0
    assert (
        episode_of(streaming)["turn_spans"] == [(0, 9)] and episode_of(streaming)["observation_spans"] == []
    )
