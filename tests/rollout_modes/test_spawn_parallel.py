"""Spawn children really run in parallel on the torch engine: the children of one spawn block are
decoded in one batch (engine batch counters, never wall clock), and batching changes no token."""

from __future__ import annotations

from asyncio import run
from typing import Any

from loom.contracts.modes import parse_mode_params
from loom.contracts.wire import RolloutRequest, SamplingParams
from rollout_svc.engines.torch import TorchEngine
from rollout_svc.modes.spawn import spawn
from zoo.tiny import make_problems, spawn_prompt

PROBLEM = make_problems("countdown", 2, seed=3)[1]  # greedy: one spawn block with 3 children


def rollout(engine: TorchEngine) -> Any:
    request = RolloutRequest(
        mode="spawn",
        prompt=spawn_prompt(PROBLEM),
        sampling=SamplingParams(max_tokens=256, temperature=0.0, n=1),
    )
    ids = engine.tokenizer.encode(request.prompt, add_special_tokens=False)
    return run(spawn(request, ids, "g", engine, engine.tokenizer, parse_mode_params(request)))


def test_the_children_of_a_spawn_block_decode_in_one_batch(tiny_engine: Any) -> None:
    def make(batching: bool) -> TorchEngine:
        return TorchEngine(
            tiny_engine.model_path,
            model=tiny_engine.model,
            tokenizer=tiny_engine.tokenizer,
            cache_entries=16,
            batching=batching,
        )

    batched, serial = make(True), make(False)
    group = rollout(batched)
    (root,) = [t for t in group.trajectories if t.parent_id is None]
    children = [t for t in group.trajectories if t.parent_id == root.id]
    assert group.meta["rollouts"][0]["status"] == "ok" and len(children) >= 2
    extra = batched.stats.extra
    # one rollout: only sibling children can ever be decoded together, and all of them were
    assert extra["peak_batch_requests"] == len(children) == extra["peak_batch_rows"]
    assert extra["batched_steps"] >= min(len(c.completion_ids) for c in children) - 2
    # forwards follow the longest dependent chain, not the sum of the calls
    assert batched.stats.decode_tokens > group.meta["sequential_tokens"]
    assert extra["decode_steps"] <= group.meta["sequential_tokens"] + len(children)  # + admission lag
    # children serialized (batching off): the very same forest, token for token
    other = rollout(serial)
    assert [(t.id, t.completion_ids, t.loss_mask) for t in other.trajectories] == [
        (t.id, t.completion_ids, t.loss_mask) for t in group.trajectories
    ]
    assert serial.stats.extra["batched_steps"] == 0
    assert serial.stats.decode_tokens == batched.stats.decode_tokens
