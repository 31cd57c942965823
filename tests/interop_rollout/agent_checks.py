"""What every agent seam must hand its trainer, checked against Loom's own record of the episode
(the gateway's job view) and a teacher-forced pass of the served weights: shared by
tests/interop_rollout/test_agent_seams.py and verl's side (verl_agent_side_checks.py).
docs/interop-rollout.md, "Agent mode at each trainer's seam"."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
import torch

from loom.clients.rollouts import trained_mask
from loom.contracts.wire import Trajectory
from tests.interop_rollout.agent_model import PROMPT

ATOL = 1e-4
AGENT = {"parser": "function", "tools": ["calculator"], "max_turns": 4}
OBSERVATION = "\n<result>5</result>\n"  # the calculator's answer to 2+3 in the function parser's wrapper
CALL = "<call>calculator(2+3)</call>"
PROMPTS = [PROMPT, "compute 2+3?"]  # both end with '?', which starts the model's call
LABEL = "5"


def loom_trajectory(url: str, api_key: str, group_id: str, trajectory_id: str) -> Trajectory:
    """The trajectory as Loom stored it: its job's view (the job id is the group id's first part)."""
    job_id = group_id.split(".")[0]
    r = httpx.get(f"{url}/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    r.raise_for_status()
    for g in r.json()["groups"]:
        for t in (g.get("group") or {}).get("trajectories", []):
            if t["id"] == trajectory_id:
                return Trajectory.model_validate(t)
    raise AssertionError(f"trajectory {trajectory_id} is not in job {job_id}")


def teacher_forced(model: Any, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """log p(completion[j] | prompt + completion[:j]) over the whole multi-turn sequence, one pass."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [float(logp[n + j - 1, tok]) for j, tok in enumerate(completion_ids)]


def check_episode(
    t: Trajectory,
    tokenizer: Any,
    model: Any,
    prompt_ids: list[int],
    completion_ids: list[int],
    mask: list[int],
    logprobs: list[float | None],
) -> int:
    """One trainer row against Loom's trajectory ``t``; the row's number of tool observations.

    (2) token-exact: the row's ids are Loom's prompt and completion ids, not a re-tokenization;
    (1) the mask is Loom's loss mask, 0 exactly on the observation segments (1 on every policy turn);
    (3) the behaviour log-probs on policy tokens equal the teacher-forced pass of the served weights
    over the whole multi-turn sequence (1e-4), and are 0.0 on the observations (never sampled)."""
    assert t.stop_reason in {"no_tool_call", "max_turns", "max_total_tokens", "max_turn_tokens"}, (
        t.stop_reason
    )
    assert prompt_ids == t.prompt_ids and completion_ids == t.completion_ids
    n = len(completion_ids)
    inside = [0] * n
    observations = [s for s in t.segments if s.kind == "observation"]
    turns = [s for s in t.segments if s.kind == "turn"]
    assert sorted((s.start, s.end) for s in turns + observations)[-1][1] == n  # the segments tile it
    for turn, s in zip(turns, observations, strict=False):  # each observation follows its turn
        inside[s.start : s.end] = [1] * (s.end - s.start)
        seen, text = completion_ids[s.start : s.end], tokenizer.decode(completion_ids[s.start : s.end])
        # the tool's output in the parser's wrapper, encoded alone and appended
        assert re.fullmatch(r"\n<result>.*</result>\n", text, re.DOTALL) and seen == tokenizer.encode(
            text, add_special_tokens=False
        ), text
        assert turn.end == s.start and s.meta["tool"] in ("calculator", None)
        if tokenizer.decode(completion_ids[turn.start : turn.end]).endswith(CALL):
            assert text == OBSERVATION and s.meta["status"] == "ok"  # Loom's calculator ran: 2+3 = 5
    assert mask == trained_mask(t) == [1 - o for o in inside]
    ref = teacher_forced(model, prompt_ids, completion_ids)
    policy = [j for j in range(n) if mask[j]]
    assert policy and [logprobs[j] for j in policy] == pytest.approx([ref[j] for j in policy], abs=ATOL)
    assert all(logprobs[j] == 0.0 for j in range(n) if inside[j])
    return len(observations)
