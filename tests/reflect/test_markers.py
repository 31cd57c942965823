"""Revisions with a Qwen3-style tokenizer (docs/models.md, "Markers with any tokenizer"): the thinking
part is found between Qwen3's ``<think>`` and ``</think>`` tokens, the forced ending's ``</think>`` is
inserted as its canonical id, and a revision is the original's prefix, the forced ending and the
policy's completion, id for id, with the fitted model's log-probs where it sampled."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from qwen3_style import encode, fitted_qwen3, qwen3_style_tokenizer, teacher_forced  # noqa: E402

from loom.contracts.settings import Settings  # noqa: E402
from loom.contracts.wire import Group, ReflectParams, RolloutRequest, SamplingParams  # noqa: E402
from loom.formats import marker_ids  # noqa: E402
from loom.runtime import configure_process  # noqa: E402

ATOL = 1e-4


def test_revision_on_a_qwen3_style_tokenizer_is_prefix_forced_ending_and_sampled_ids(tmp_path: Path) -> None:
    from reflect_svc.revise import assemble_revisions, plan_revisions
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.rollout import generate_group

    configure_process()
    tok = qwen3_style_tokenizer()
    think_open, think_close = marker_ids(tok, "<think>"), marker_ids(tok, "</think>")
    prompt = encode(tok, "[reflect] 3+4\n")
    thinking = encode(tok, " we have 3 and 4. add them. 3+4=7.") + encode(tok, " Wait, check: 4+3=7.")
    completion = think_open + thinking + think_close + encode(tok, " \\boxed{7}") + [tok.eos_token_id]
    model = fitted_qwen3(tok, [prompt + completion], tmp_path / "m", steps=200)
    engine = TorchEngine(tmp_path / "m", cache_entries=8)

    def rollout(request: RolloutRequest) -> Group:
        return asyncio.run(generate_group(request, engine, lambda: tok, Settings()))

    try:
        greedy = SamplingParams(n=1, max_tokens=48, temperature=0.0)
        group = rollout(RolloutRequest(group_id="g", prompt_ids=prompt, sampling=greedy, label="7"))
        original = group.trajectories[0]
        assert original.completion_ids == completion  # the fitted model writes the reflective trace
        params = ReflectParams(detector="heuristic", min_chunk_tokens=1, max_chunk_tokens=8, max_tokens=8)
        plan = plan_revisions(group, params, tok)
        assert len(plan.cuts) == len(plan.requests) == 1
        cut, info = plan.cuts[0], plan.revisions[0]
        assert cut.meta["think_tokens"] == len(thinking)  # the thinking part ends at the </think> token
        assert 1 <= cut.cut < 1 + len(thinking)
        forced = encode(tok, "\n") + think_close + encode(tok, "\n\n**Final Answer:**\n\n")
        assert cut.forced_ids == forced
        assert info.revision_id is not None
        request = plan.requests[0].model_copy(
            update={"sampling": greedy.model_copy(update={"max_tokens": 8})}
        )
        revised = assemble_revisions(group, params, plan, [rollout(request)], tok)
    finally:
        engine.stop_scheduler()
    rev = revised.trajectories[1]
    assert rev.parent_id == original.id
    sampled = rev.completion_ids[cut.cut + len(forced) :]
    assert rev.completion_ids == completion[: cut.cut] + forced + sampled and sampled
    assert rev.loss_mask == [1] * cut.cut + [0] * len(forced) + [1] * len(sampled)
    want = teacher_forced(model, rev.prompt_ids + rev.completion_ids, len(rev.prompt_ids))
    assert rev.logprobs is not None
    kept = [i for i, m in enumerate(rev.loss_mask) if m]
    assert [rev.logprobs[i] for i in kept] == pytest.approx([want[i] for i in kept], abs=ATOL)
    assert all(rev.logprobs[i] == 0.0 for i in range(cut.cut, cut.cut + len(forced)))
