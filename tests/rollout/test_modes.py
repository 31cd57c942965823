"""plain and streaming modes on both engines: token exactness of the trajectories, loss masks,
typed segments, caps, latency accounting, and clear errors where an engine lacks a capability."""

from __future__ import annotations

from typing import Any

import pytest

from loom.contracts.settings import Settings
from loom.contracts.wire import RolloutRequest, SamplingParams
from loom.formats import DEFAULT_MARKERS as M
from rollout_svc.engines.base import Layout, UnsupportedCapability
from rollout_svc.engines.torch import teacher_forced_logprobs
from rollout_svc.modes import ModeError
from rollout_svc.rollout import generate_group

ATOL = 1e-4
SENTENCES = ["the first number is 12.", "the second number is 30.", "find their sum."]


def run_group(arun: Any, engine: Any, tokenizer: Any, request: RolloutRequest) -> Any:
    return arun(generate_group(request, engine, lambda: tokenizer, Settings()))


def streaming_request(layout: str = "interleaved", **mode_params: Any) -> RolloutRequest:
    return RolloutRequest(
        group_id="g-stream",
        mode="streaming",
        prompt="[stream]",
        sampling=SamplingParams(n=2, max_tokens=12, seed=9, temperature=1.0),
        mode_params={"sentences": SENTENCES, "layout": layout, "segment_cap": 6, "answer_max_tokens": 6}
        | mode_params,
    )


def assert_exact(traj: Any, model: Any, layout: Layout | None = None) -> None:
    """Every trained token's log-prob equals the teacher-forced pass over the same layout."""
    ids = traj.prompt_ids + traj.completion_ids
    ref = teacher_forced_logprobs(model, ids, len(traj.prompt_ids), layout)
    mask = traj.loss_mask or [1] * len(traj.completion_ids)
    trained = [i for i, m in enumerate(mask) if m]
    assert trained
    assert [traj.logprobs[i] for i in trained] == pytest.approx([ref[i] for i in trained], abs=ATOL)


def test_plain_group_is_token_exact(engine: Any, arun: Any, tokenizer: Any, reference_model: Any) -> None:
    req = RolloutRequest(
        group_id="g1", prompt="what is 2+2?", sampling=SamplingParams(n=3, max_tokens=10, seed=1)
    )
    group = run_group(arun, engine, tokenizer, req)
    assert group.id == "g1" and group.mode == "plain" and len(group.trajectories) == 3
    for i, t in enumerate(group.trajectories):
        assert t.id == f"g1/{i}" and t.engine == engine.name and t.policy_version == engine.policy_version
        assert t.prompt_ids == tokenizer.encode("what is 2+2?", add_special_tokens=False)
        assert_exact(t, reference_model)


def test_streaming_interleaved_is_token_exact_with_masked_observations(
    engine: Any, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    group = run_group(arun, engine, tokenizer, streaming_request())
    assert group.mode == "streaming" and len(group.trajectories) == 2
    for t in group.trajectories:
        assert_exact(t, reference_model)
        kinds = [s.kind for s in t.segments]
        assert kinds[:2] == ["observation", "stream"]
        obs = [s for s in t.segments if s.kind == "observation" and not s.meta.get("connector")]
        for s, sentence in zip(obs, SENTENCES, strict=False):
            expected = tokenizer.encode(f" {sentence}{M.sentence_end}", add_special_tokens=False)
            assert t.completion_ids[s.start : s.end] == expected
            assert set(t.loss_mask[s.start : s.end]) == {0}
        for s in t.segments:
            if s.kind == "stream":
                body = t.loss_mask[s.start : s.end]
                assert s.end - s.start <= 6 + 1  # segment cap plus a forced <EOT>
                assert t.completion_ids[s.end - 1] == tokenizer.convert_tokens_to_ids(M.thought_end) or (
                    t.meta.get("ended_early") == "stream"
                )
                assert body[:-1] == [1] * (len(body) - 1)
                assert body[-1] == (0 if s.meta["forced_end"] else 1)
        if "ended_early" not in t.meta:
            assert [s.index for s in obs] == [0, 1, 2]
            assert kinds[-3:] == ["observation", "deep", "answer"]


def test_streaming_group_position_layout_is_token_exact(
    local_engine: Any, arun: Any, tokenizer: Any, reference_model: Any
) -> None:
    group = run_group(arun, local_engine, tokenizer, streaming_request("group_positions"))
    for t in group.trajectories:
        groups = t.meta["completion_groups"]
        full = Layout(groups=[0] * len(t.prompt_ids) + groups, gen_group=1)
        assert_exact(t, reference_model, full)
        for s in t.segments:  # sources are group 0, model tokens group 1
            assert set(groups[s.start : s.end]) <= ({0} if s.kind == "observation" else {1})


def test_group_positions_on_the_vllm_engine_is_a_clear_error(
    vllm_engine: Any, arun: Any, tokenizer: Any
) -> None:
    with pytest.raises(UnsupportedCapability, match="group_positions"):
        run_group(arun, vllm_engine, tokenizer, streaming_request("group_positions"))


def test_streaming_latency_is_accounted_at_the_reading_speed(
    torch_engine: Any, arun: Any, tokenizer: Any
) -> None:
    group = run_group(arun, torch_engine, tokenizer, streaming_request(reading_wpm=60.0))
    words = sum(len(s.split()) for s in SENTENCES)
    for t in group.trajectories:
        assert t.timing["reading_s"] == pytest.approx(60.0 * words / 60.0)
        if "ended_early" not in t.meta:
            assert t.timing["latency_s"] >= 0.0
            last_stream = [s for s in t.segments if s.kind == "stream"][-1]
            deep = next(s for s in t.segments if s.kind == "deep")
            # tokens decoded after the last sentence arrived, up to and including the first answer token
            forced = int(last_stream.meta["forced_end"]) + int(deep.meta["forced_end"])
            assert (
                t.meta["latency_tokens"]
                == (last_stream.end - last_stream.start) + (deep.end - deep.start) + 1 - forced
            )


@pytest.mark.parametrize(
    ("mode", "mode_params", "needle"),
    [
        ("plain", {"layout": "interleaved"}, "no mode_params"),
        ("streaming", {}, "sentences"),
        ("streaming", {"sentences": SENTENCES, "layout": "diagonal"}, "layout"),
        ("streaming", {"sentences": SENTENCES, "segment_cap": 0}, "segment_cap"),
        ("streaming", {"sentences": SENTENCES, "typo": 1}, "typo"),
        ("streaming", {"sentences": SENTENCES, "reading_wpm": 0}, "reading_wpm must be a finite number > 0"),
        ("streaming", {"sentences": SENTENCES, "reading_wpm": -150}, "reading_wpm"),
        ("streaming", {"sentences": SENTENCES, "deep_max_tokens": 0}, "deep_max_tokens must be in"),
        ("streaming", {"sentences": SENTENCES, "answer_max_tokens": -5}, "answer_max_tokens must be in"),
        ("plain", {"sentences": SENTENCES}, "plain takes no mode_params"),
    ],
)
def test_bad_mode_requests_name_the_problem(
    torch_engine: Any, arun: Any, tokenizer: Any, mode: str, mode_params: dict, needle: str
) -> None:
    req = RolloutRequest(mode=mode, prompt="x", mode_params=mode_params)  # type: ignore[arg-type]
    with pytest.raises(ModeError, match=needle):
        run_group(arun, torch_engine, tokenizer, req)


def test_streaming_on_the_shipped_tiny_checkpoint_is_token_exact(arun: Any) -> None:
    """The built-in tiny model in its own stream format (zoo/tiny): exact log-probs, typed segments."""
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR, STREAM_HEADER, make_problems
    from zoo.tiny.traces import stream_sentences

    if not (CHECKPOINT_DIR / "config.json").exists():
        pytest.skip(f"the tiny checkpoint is not built at {CHECKPOINT_DIR} (run `loom train-tiny`)")
    engine = TorchEngine(CHECKPOINT_DIR)
    (problem,) = make_problems("arith", 1, seed=3)
    req = RolloutRequest(
        mode="streaming",
        prompt=STREAM_HEADER,
        sampling=SamplingParams(n=2, max_tokens=64, seed=0, temperature=1.0),
        mode_params={"sentences": stream_sentences(problem), "segment_cap": 32, "answer_max_tokens": 16},
    )
    group = run_group(arun, engine, engine.tokenizer, req)
    for t in group.trajectories:
        assert_exact(t, engine.model)
        assert t.segments[0].kind == "observation" and t.segments[1].kind == "stream"


def test_streaming_ends_a_sample_at_the_context_instead_of_failing_the_group(
    tmp_path: Any, arun: Any
) -> None:
    """A stream step capped by the context (finish "length") is followed by more observations: the
    next call would not fit, so the sample ends there ("length", ended_early "context"); it used to
    be refused with InvalidPrompt and take the whole group down."""
    import json
    from collections import Counter

    from rollout_svc.engines.torch import TorchEngine
    from tests.rollout.conftest import build_model_dir

    d = build_model_dir(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    engine = TorchEngine(d, cache_entries=4)
    for layout in ("interleaved", "group_positions"):
        request = streaming_request(layout, segment_cap=40)
        request.sampling = request.sampling.model_copy(update={"max_tokens": 200})
        group = run_group(arun, engine, engine.tokenizer, request)
        for t in group.trajectories:
            groups = [0] * len(t.prompt_ids) + t.meta.get("completion_groups", [0] * len(t.completion_ids))
            assert max(Counter(groups).values()) <= 96  # nothing appended past the context
            if t.meta.get("ended_early") == "context":
                assert t.finish_reason == "length"
        assert any(t.meta.get("ended_early") == "context" for t in group.trajectories), layout


def test_room_is_what_the_context_leaves(local_engine: Any) -> None:
    engine = local_engine
    limit = engine.max_model_len
    assert engine.room([1] * 10) == limit - 10
    assert engine.room([1] * (limit + 5)) == 0
    layout = Layout(groups=[0] * 10 + [1] * 3, gen_group=1)
    assert engine.room([1] * 13, layout) == limit - 3  # positions count per group
    assert engine.room([1] * (limit + 1), Layout(groups=[0] * (limit + 1), gen_group=1)) == 0
