"""Streaming and spawn with a tokenizer that has none of Loom's markers as tokens (docs/models.md,
"Markers with any tokenizer"): a Qwen3-style byte-level BPE where ``<EOT>`` or APR's spawn close is
several ids. A tiny Qwen3 is fitted to the exact ids each mode builds, so greedy decoding writes the
markers and the modes must match them on their canonical ids, insert the forced markers and join
blocks as canonical ids, and keep the log-probs those of a teacher-forced pass."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1]))
from qwen3_style import encode, fitted_qwen3, qwen3_style_tokenizer, teacher_forced  # noqa: E402

from loom.contracts.settings import Settings  # noqa: E402
from loom.contracts.wire import RolloutRequest, SamplingParams, Trajectory  # noqa: E402
from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, encode_with_markers, marker_ids  # noqa: E402
from loom.runtime import configure_process  # noqa: E402
from rollout_svc.engines.base import UnsupportedCapability  # noqa: E402

ATOL = 1e-4


@pytest.fixture(scope="module")
def tok() -> Any:
    configure_process()
    return qwen3_style_tokenizer()


def run_group(path: Path, tok: Any, request: RolloutRequest, id_sequences: bool = True) -> Any:
    """``request``'s group on the torch engine; ``id_sequences=False``: the engine without its
    ``stop_sequences`` capability, as the vLLM client is (stops on single ids and on text only)."""
    from rollout_svc.engines.torch import TorchEngine
    from rollout_svc.rollout import generate_group

    engine = TorchEngine(path, cache_entries=8)
    if not id_sequences:
        engine.capabilities = engine.capabilities - {"stop_sequences"}
    try:
        return asyncio.run(generate_group(request, engine, lambda: tok, Settings()))
    finally:
        engine.stop_scheduler()


def assert_teacher_forced(model: Any, t: Trajectory) -> None:
    """Sampled tokens carry the fitted model's log-probs; inserted ones 0.0 and loss mask 0."""
    want = teacher_forced(model, t.prompt_ids + t.completion_ids, len(t.prompt_ids))
    mask = t.loss_mask or [1] * len(t.completion_ids)
    assert t.logprobs is not None and len(t.logprobs) == len(mask) == len(t.completion_ids)
    sampled = [i for i, m in enumerate(mask) if m]
    assert [t.logprobs[i] for i in sampled] == pytest.approx([want[i] for i in sampled], abs=ATOL)
    assert all(t.logprobs[i] == 0.0 for i, m in enumerate(mask) if not m)


def test_streaming_matches_and_inserts_multi_token_markers(tok: Any, tmp_path: Path) -> None:
    """Each streaming marker is several ids here. A thought that spells ``<EOT>`` with other ids (one
    per character) goes on; the canonical ids end it; the skip marker ends the second thought and the
    forced ``<EOT>`` after it is the canonical ids, untrained; ``<EOR>`` and ``<EOA>`` end the deep
    phase and the answer. The completion is exactly the sampled and the inserted ids in order."""
    m = DEFAULT_MARKERS
    eot, skip, eor, eoa, eos = (
        marker_ids(tok, x) for x in (m.thought_end, m.skip, m.reasoning_end, m.answer_end, m.sentence_end)
    )
    assert min(len(x) for x in (eot, skip, eor, eoa, eos)) > 1  # none of Loom's markers is a token
    spelled = tok.convert_tokens_to_ids(list(m.thought_end))
    assert spelled != eot and tok.decode(spelled) == m.thought_end  # the same text, other ids

    sentences = ["we have 3 and 4.", "add them."]
    prompt = encode(tok, "[stream]")
    c1, c2 = (encode(tok, f" {s}") + eos for s in sentences)
    r1 = encode(tok, " we") + spelled + encode(tok, " add") + eot
    r2 = encode(tok, " 7") + skip
    connector = encode(tok, " " + m.connector)
    deep = encode(tok, " 3+4=7") + eor
    answer = encode(tok, " \\boxed{7}") + eoa
    pieces = [c1, r1, c2, r2, eot, connector, deep, answer]
    trained = [0, 1, 0, 1, 0, 0, 1, 1]
    completion = [i for p in pieces for i in p]
    model = fitted_qwen3(tok, [prompt + completion], tmp_path / "m")

    request = RolloutRequest(
        group_id="g-stream",
        mode="streaming",
        prompt="[stream]",
        sampling=SamplingParams(n=1, max_tokens=32, temperature=0.0),
        mode_params={"sentences": sentences, "segment_cap": 24, "answer_max_tokens": 16},
    )
    t = run_group(tmp_path / "m", tok, request).trajectories[0]
    assert t.prompt_ids == prompt
    assert t.completion_ids == completion
    assert t.loss_mask == [k for p, k in zip(pieces, trained, strict=True) for _ in p]
    assert_teacher_forced(model, t)
    streams = [s for s in t.segments if s.kind == "stream"]
    assert [s.meta["skipped"] for s in streams] == [False, True]
    assert [s.meta["forced_end"] for s in streams] == [False, True]
    first = t.completion_ids[streams[0].start : streams[0].end]
    assert first == r1  # the spelled-out <EOT> did not end the thought; its canonical ids did
    assert t.finish_reason == "stop" and "ended_early" not in t.meta
    with pytest.raises(UnsupportedCapability, match="stop_sequences"):
        run_group(tmp_path / "m", tok, request, id_sequences=False)


def test_spawn_matches_a_multi_token_close_and_joins_canonical_ids(tok: Any, tmp_path: Path) -> None:
    """APR's spawn close is several ids: the parent stops on exactly them, its two children run, each
    returns the text after its ``</think>`` token, and the join block is inserted as the canonical
    ids of the join text (untrained) between the parent's two sampled spans."""
    from rollout_svc.modes.spawn import join_text

    syntax = DEFAULT_SPAWN
    markers = [syntax.spawn_open, syntax.spawn_close, syntax.join_open, syntax.join_close, "</think>"]
    close = marker_ids(tok, syntax.spawn_close)
    assert len(close) > 1
    think_open, think_close = marker_ids(tok, "<think>"), marker_ids(tok, "</think>")
    assert len(think_open) == len(think_close) == 1  # Qwen3's think tokens

    prompt = encode(tok, "[spawn] 3 4 7\n")
    block = (
        f"{syntax.spawn_open}\n"
        f"{syntax.spawn_child.format(i=0, node=0)} 3+4\n"
        f"{syntax.spawn_child.format(i=1, node=1)} 4+3\n"
        f"{syntax.spawn_close}"
    )
    span1 = encode_with_markers(tok, block, markers)
    assert span1[-len(close) :] == close
    join = encode_with_markers(tok, join_text(["7", "7"], syntax), markers)
    span2 = encode(tok, " \\boxed{7}") + [tok.eos_token_id]
    children = [encode(tok, f"[child] {x}\n") for x in ("3+4", "4+3")]
    child_out = [
        think_open + encode(tok, f" {x}=7") + think_close + encode(tok, " 7") + [tok.eos_token_id]
        for x in ("3+4", "4+3")
    ]
    model = fitted_qwen3(
        tok,
        [prompt + span1 + join + span2, *(p + c for p, c in zip(children, child_out, strict=True))],
        tmp_path / "m",
    )

    request = RolloutRequest(
        group_id="g-spawn",
        mode="spawn",
        prompt="[spawn] 3 4 7\n",
        sampling=SamplingParams(n=1, max_tokens=96, temperature=0.0),
        mode_params={"child_max_tokens": 24},
    )
    group = run_group(tmp_path / "m", tok, request)
    assert group.meta["rollouts"][0]["status"] == "ok"
    root, *kids = group.trajectories
    assert root.parent_id is None and [k.parent_id for k in kids] == [root.id, root.id]
    assert root.completion_ids == span1 + join + span2
    assert root.loss_mask == [1] * len(span1) + [0] * len(join) + [1] * len(span2)
    assert [s.kind for s in root.segments] == ["thread", "observation", "thread"]
    assert [k.prompt_ids for k in kids] == children
    assert [k.completion_ids for k in kids] == child_out
    assert [link.message for link in group.threads] == ["7", "7"]
    for t in group.trajectories:
        assert_teacher_forced(model, t)
    # where the engine cannot stop on id sequences, the close's text stops the parent and its ids
    # still decide: the same group, id for id
    by_text = run_group(tmp_path / "m", tok, request, id_sequences=False)
    assert [t.completion_ids for t in by_text.trajectories] == [t.completion_ids for t in group.trajectories]
    assert by_text.meta["rollouts"][0]["status"] == "ok"


def test_a_spawn_close_spelled_with_other_ids_never_spawns(tok: Any, tmp_path: Path) -> None:
    """The close marker's text written one id per character is not the marker: on the torch engine
    the parent does not stop there and ends unclosed; where the close's text is the stop (no id
    sequences) the stop fires and the ids refuse it. Both are format errors, and no child runs."""
    syntax = DEFAULT_SPAWN
    markers = [syntax.spawn_open, syntax.spawn_close, syntax.join_open, syntax.join_close, "</think>"]
    prompt = encode(tok, "[spawn] 3 4 7\n")
    head = f"{syntax.spawn_open}\n{syntax.spawn_child.format(i=0, node=0)} 3+4\n"
    spelled = [i for ch in syntax.spawn_close for i in encode(tok, ch)]
    assert spelled != marker_ids(tok, syntax.spawn_close) and tok.decode(spelled) == syntax.spawn_close
    completion = encode_with_markers(tok, head, markers) + spelled + [tok.eos_token_id]
    fitted_qwen3(tok, [prompt + completion], tmp_path / "m")
    request = RolloutRequest(
        group_id="g-spelled",
        mode="spawn",
        prompt="[spawn] 3 4 7\n",
        sampling=SamplingParams(n=1, max_tokens=64, temperature=0.0),
    )
    by_ids = run_group(tmp_path / "m", tok, request)
    by_text = run_group(tmp_path / "m", tok, request, id_sequences=False)
    assert [t.completion_ids for t in by_ids.trajectories] == [completion]
    assert [t.completion_ids for t in by_text.trajectories] == [completion[:-1]]  # stopped on the text
    reasons = [g.meta["rollouts"][0] for g in (by_ids, by_text)]
    assert [r["status"] for r in reasons] == ["format_error", "format_error"]
    assert [r["reason"] for r in reasons] == [
        "unclosed spawn block",
        "spawn close marker not written as its canonical token ids",
    ]
