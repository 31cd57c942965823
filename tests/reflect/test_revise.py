"""Revision: the half limit, the discard rules, and one end-to-end revise through the real services
(reflect API -> rollout API on the torch engine with the tiny model, reward API with its verifier)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reflect_helpers import trace_group  # noqa: E402

from loom.clients.reflect import ReflectClient  # noqa: E402
from loom.contracts.wire import (  # noqa: E402
    Group,
    ReflectParams,
    RewardResult,
    Trajectory,
    TrajectoryReward,
)
from loom.formats import FORCED_ENDING  # noqa: E402
from reflect_svc.chunking import Chunk, Thinking, chunk_thinking  # noqa: E402
from reflect_svc.revise import (  # noqa: E402
    build_revision,
    keep_revision,
    limit_cut,
    revise_group,
    unique_revision_id,
)


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


class CorrectServices:
    """Every chunk states the answer, every completion is " 7." and every trajectory is correct."""

    def __init__(self, tok):
        self.tok = tok

    def match(self, group, texts):
        return [True] * len(texts)

    def complete(self, requests):
        ids = self.tok.encode(" 7.", add_special_tokens=False)
        return [
            Group(id=r.group_id, trajectories=[Trajectory(id="x", group_id=r.group_id, completion_ids=ids)])
            for r in requests
        ]

    def score(self, group, spec):
        rewards = [TrajectoryReward(trajectory_id=t.id, total=1.0) for t in group.trajectories]
        return RewardResult(group_id=group.id, rewards=rewards)


def test_a_revision_carries_the_policy_version_and_namespace_that_generated_its_ending():
    original = Trajectory(id="g.0", group_id="g", completion_ids=[5, 6, 7, 8], logprobs=[-1.0] * 4)
    generated = Trajectory(
        id="r",
        group_id="r",
        completion_ids=[9, 10],
        logprobs=[-0.5, -0.25],
        policy_version=3,
        policy_namespace="trainer",
        engine="torch",
    )
    rev = build_revision(original, 2, [11], generated, None, {})
    assert rev.completion_ids == [5, 6, 11, 9, 10] and rev.loss_mask == [1, 1, 0, 1, 1]
    assert (rev.policy_version, rev.policy_namespace) == (3, "trainer")
    assert rev.logprobs == [-1.0, -1.0, 0.0, -0.5, -0.25]


def test_revision_ids_stay_unique_when_an_original_is_named_like_a_revision(tok):
    """ids t0 and t0.rev gave ['t0', 't0.rev', 't0.rev', 't0.rev.rev'] (and mixed up their rewards)."""
    g = trace_group(tok, "arith", n=2, seed=8)
    t0, t1 = g.trajectories
    group = g.model_copy(update={"trajectories": [t0, t1.model_copy(update={"id": "t0.rev"})]})
    res = revise_group(group, ReflectParams(min_chunk_tokens=8), CorrectServices(tok), tok)
    ids = [t.id for t in res.group.trajectories]
    assert ids == ["t0", "t0.rev2", "t0.rev", "t0.rev.rev"]
    parents = [(t.id, t.parent_id) for t in res.group.trajectories if t.parent_id]
    assert parents == [("t0.rev2", "t0"), ("t0.rev.rev", "t0.rev")]
    assert [i.revision_id for i in res.revisions] == ["t0.rev2", "t0.rev.rev"]
    assert res.group.meta["reflect"]["revisions"] == {"t0.rev2": "t0", "t0.rev.rev": "t0.rev"}


def test_unique_revision_ids_count_up_and_fit_the_schema():
    taken = {"a", "a.rev", "a.rev2"}
    assert unique_revision_id("a", taken) == "a.rev3" and unique_revision_id("a", taken) == "a.rev4"
    long_id = "x" * 200
    rid = unique_revision_id(long_id, taken)
    assert len(rid) <= 200 and rid != unique_revision_id(long_id, taken)


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
