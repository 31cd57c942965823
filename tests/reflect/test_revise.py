"""Revision: the half limit, the discard rules, and one end-to-end revise through the real services
(reflect API -> rollout API on the torch engine with the tiny model, reward API with its verifier)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from reflect_helpers import serve, trace_group  # noqa: E402

from loom.clients.reflect import ReflectClient  # noqa: E402
from loom.formats import FORCED_ENDING  # noqa: E402
from loom.schemas import ReflectParams  # noqa: E402
from reflect_svc.chunking import Chunk, Thinking, chunk_thinking  # noqa: E402
from reflect_svc.revise import keep_revision, limit_cut  # noqa: E402


def test_never_more_than_half_of_the_thinking_tokens_go():
    th = Thinking(start=10, end=110, chunks=[Chunk(10 + 20 * i, 30 + 20 * i, "x.") for i in range(5)])
    assert limit_cut(th, 30) == 70  # would remove 80: moved to the first chunk end keeping >= 50
    assert limit_cut(th, 70) == 70  # removes 40: allowed
    assert limit_cut(th, 50, 0.5) == 70
    assert limit_cut(th, 30, 0.0) == 110  # nothing may go
    th2 = Thinking(start=0, end=100, chunks=[Chunk(0, 10, "a."), Chunk(10, 100, "b.")])
    assert limit_cut(th2, 10) == 100  # no chunk boundary keeps half: nothing to remove


def test_discard_rules():
    assert keep_revision(True, True) == (True, None)
    assert keep_revision(False, True) == (True, None)
    assert keep_revision(True, False) == (False, "original_correct_revision_wrong")
    assert keep_revision(False, False) == (False, "both_wrong")


@pytest.fixture(scope="module")
def reflect_url(rollout_url: str, reward_url: str) -> Iterator[str]:
    import os

    from loom.settings import get_settings
    from reflect_svc.config import get_reflect_settings

    saved = {
        k: os.environ.get(k)
        for k in ("LOOM_REFLECT_TRANSPORT", "LOOM_REFLECT_ROLLOUT_URL", "LOOM_REFLECT_REWARD_URL")
    }
    os.environ.update(
        LOOM_REFLECT_TRANSPORT="http",
        LOOM_REFLECT_ROLLOUT_URL=rollout_url,
        LOOM_REFLECT_REWARD_URL=reward_url,
    )
    get_reflect_settings.cache_clear()
    get_settings.cache_clear()
    from reflect_svc.api import app

    try:
        with serve(app) as url:
            yield url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        get_reflect_settings.cache_clear()


def test_end_to_end_revise_through_rollout_and_reward(tok, reflect_url):
    group = trace_group(tok, "arith", n=3, seed=8, wrong=(2,))
    params = ReflectParams(
        detector="gold", min_chunk_tokens=8, max_tokens=24, temperature=0.0, keep_discarded=True
    )
    with ReflectClient(reflect_url) as client:
        res = client.revise(group, params)
    infos = {i.trajectory_id: i for i in res.revisions}
    assert set(infos) == {"t0", "t1", "t2"}
    assert infos["t2"].status == "no_detection"  # a wrong trace never states the gold answer
    forced = tok.encode(FORCED_ENDING, add_special_tokens=False)
    by_id = {t.id: t for t in res.group.trajectories}
    dec = lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)  # noqa: E731
    for tid in ("t0", "t1"):
        info, orig = infos[tid], by_id[tid]
        # chunk 0 states the answer; the half limit moves the cut to the first chunk end keeping half
        th = chunk_thinking(orig.completion_ids, dec, min_tokens=8)
        expected = next(k for k, c in enumerate(th.chunks) if th.end - c.end <= th.n_tokens / 2)
        assert info.status == "truncated" and info.chunk == expected and info.original_correct is True
        assert 0 < info.removed_tokens <= info.think_tokens / 2
        rev = by_id[info.revision_id]
        cut = info.cut
        assert rev.parent_id == tid and rev.meta["revision_of"] == tid
        assert rev.completion_ids[:cut] == orig.completion_ids[:cut]
        assert rev.completion_ids[cut : cut + len(forced)] == forced
        assert rev.loss_mask[cut : cut + len(forced)] == [0] * len(forced)
        assert rev.logprobs is not None and len(rev.logprobs) == len(rev.completion_ids)
        (seg,) = [s for s in rev.segments if s.kind == "revision"]
        assert (seg.start, seg.end, seg.meta["of"]) == (cut, len(rev.completion_ids), tid)
        assert f"So the answer is {group.label}." in tok.decode(rev.completion_ids[:cut])
        # discard rule applied to the real verdicts of the tiny model's completion
        assert info.kept == bool(info.revision_correct)
        assert info.discard_reason == (None if info.revision_correct else "original_correct_revision_wrong")
        assert ("discarded" in rev.meta) == (not info.kept)
    # each revision sits right after its original
    ids = [t.id for t in res.group.trajectories]
    for tid in ("t0", "t1"):
        assert ids[ids.index(tid) + 1] == infos[tid].revision_id
    kept = res.group.meta["reflect"]["revisions"]
    assert kept == {infos[t].revision_id: t for t in ("t0", "t1") if infos[t].kept}


def test_model_detector_without_a_model_is_a_typed_status(tok, reflect_url):
    group = trace_group(tok, "arith", n=1, seed=8)
    with ReflectClient(reflect_url) as client:
        res = client.revise(group, ReflectParams(detector="model"))
    assert [i.status for i in res.revisions] == ["model_error"]
    assert [t.id for t in res.group.trajectories] == ["t0"]
