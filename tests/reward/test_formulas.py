"""Each reward formula pinned against hand-computed cases (docs/algorithms.md §1)."""

import math

import pytest

from loom.answers import last_boxed
from loom.contracts.wire import Group, Segment, Trajectory
from reward_svc.context import GroupContext
from reward_svc.efficiency import efficiency, r_eff
from reward_svc.format import format_deep, format_spawn, format_stream, format_think, spawn_ok, think_ok
from reward_svc.length import kimi_lambda, length_deep, length_kimi, length_refined, length_stream
from reward_svc.reflection import DensityStats, count_reflections, reflection, reflection_reward
from reward_svc.trace import answer_region, split_streaming, view_of

STREAM_OK = (
    "C1<EOS> a thought<EOT> C2<EOS><ignore><EOT> Now reason step by step, then answer."
    " deep work<EOR> \\boxed{4}<EOA>"
)


def ctx_of(texts=None, *, lengths=None, correct=None, trajs=None, state=None):
    if trajs is None:
        if lengths is not None:
            trajs = [
                Trajectory(id=f"t{i}", group_id="g", completion_ids=[0] * n, text="x")
                for i, n in enumerate(lengths)
            ]
        else:
            trajs = [Trajectory(id=f"t{i}", group_id="g", text=t) for i, t in enumerate(texts)]
    g = Group(id="g", label="4", trajectories=trajs)
    return GroupContext(group=g, views=[view_of(t) for t in trajs], correct=correct, state=state)


# ---------------------------------------------------------------- length (REA-RL eq. 1, 4)


def test_kimi_lambda_hand_computed():
    assert kimi_lambda([10, 20, 30]) == [1.0, 0.5, 0.0]


def test_kimi_length_reward_caps_incorrect_at_half():
    ctx = ctx_of(lengths=[10, 20, 30], correct=[1.0, 0.0, 0.0])
    assert length_kimi(ctx, {}) == [1.0, 0.5, 0.0]
    ctx = ctx_of(lengths=[10, 20, 30], correct=[0.0, 1.0, 1.0])
    assert length_kimi(ctx, {}) == [0.5, 0.5, 0.0]


def test_all_equal_lengths_give_zero_length_reward():
    ctx = ctx_of(lengths=[7, 7, 7], correct=[1.0, 0.0, 1.0])
    assert length_kimi(ctx, {}) == [0.0, 0.0, 0.0]
    assert length_refined(ctx, {}) == [0.0, 0.0, 0.0]
    assert length_refined(ctx, {"variant": "authors"}) == [0.0, 0.0, 0.0]


def test_refined_length_is_zero_when_incorrect():
    ctx = ctx_of(lengths=[10, 20, 30], correct=[0.0, 1.0, 1.0])
    assert length_refined(ctx, {}) == [0.0, 0.5, 0.0]


def test_refined_authors_variant_uses_correct_samples_with_half_shift():
    # correct lengths 20 and 40: min_c=20, max_c=40 -> 0.5 - 0 and 0.5 - 1
    ctx = ctx_of(lengths=[10, 20, 40, 30], correct=[0.0, 1.0, 1.0, 0.0])
    assert length_refined(ctx, {"variant": "authors"}) == [0.0, 0.5, -0.5, 0.0]


def test_adasr_phase_penalties_eq6_from_segments():
    t = Trajectory(
        id="t0",
        group_id="g",
        completion_ids=list(range(20)),
        segments=[
            Segment(kind="stream", start=0, end=3),
            Segment(kind="stream", start=3, end=10),
            Segment(kind="deep", start=10, end=17),
            Segment(kind="answer", start=17, end=20),
        ],
        text=STREAM_OK,
    )
    ctx = ctx_of(trajs=[t])
    assert length_stream(ctx, {}) == pytest.approx([(-math.log(4) - math.log(8)) / 2])
    assert length_deep(ctx, {}) == pytest.approx([-math.log(8)])


def test_adasr_appendix_c_length_penalty_is_not_gated_by_accuracy():
    """Appendix C: with a gate, incorrect rollouts get penalty 0 and out-rank the correct long one.
    Loom's R^{Ls} is ungated, so the failed rollouts pay their own length cost."""
    long_thought = " ".join(["step"] * 200)
    short = "C1<EOS> ok<EOT> deep<EOR> \\boxed{5}<EOA>"
    texts = [f"C1<EOS> {long_thought}<EOT> deep<EOR> \\boxed{{4}}<EOA>", short, short, short]
    correct = [1.0, 0.0, 0.0, 0.0]
    ctx = ctx_of(texts, correct=correct)
    ungated = length_stream(ctx, {})
    assert ungated[0] == pytest.approx(-math.log(1 + 200))
    assert all(x == pytest.approx(-math.log(2)) for x in ungated[1:])  # the failed ones are penalised too
    gated = [a * x for a, x in zip(correct, ungated, strict=True)]  # the hackable design of appendix C
    assert gated[1:] == [0.0, 0.0, 0.0] and gated[0] < 0  # failing the gate beats being correct


def test_format_stream_and_deep_are_separate():
    texts = [
        STREAM_OK,
        "C1<EOS> a thought C2<EOS> more<EOT> deep<EOR>",
        "C1<EOS> thought<EOT> deep never ends",
    ]
    ctx = ctx_of(texts)
    assert format_stream(ctx, {}) == [1.0, 0.0, 1.0]
    assert format_deep(ctx, {}) == [1.0, 1.0, 0.0]


def test_format_stream_content_must_be_thought_or_exact_skip():
    ctx = ctx_of(
        ["C1<EOS>  <EOT> d<EOR>", "C1<EOS> <ignore> and more<EOT> d<EOR>", "C1<EOS> <ignore> <EOT> d<EOR>"]
    )
    assert format_stream(ctx, {}) == [0.0, 0.0, 1.0]


def test_format_from_segment_texts():
    t = Trajectory(
        id="t0",
        group_id="g",
        completion_ids=list(range(6)),
        text="ignored",
        segments=[
            Segment(kind="stream", start=0, end=2, meta={"text": "hi<EOT>"}),
            Segment(kind="stream", start=2, end=3, meta={"text": "no end"}),
            Segment(kind="deep", start=3, end=6, meta={"text": "deep<EOR>"}),
        ],
    )
    ctx = ctx_of(trajs=[t])
    assert format_stream(ctx, {}) == [0.0]
    assert format_deep(ctx, {}) == [1.0]


def test_format_think_and_boxed():
    assert think_ok("<think>reason</think> so \\boxed{3}", "<think>", "</think>")
    assert not think_ok("<think></think> \\boxed{3}", "<think>", "</think>")
    assert not think_ok("<think>r</think> 3", "<think>", "</think>")
    assert not think_ok("x <think>r</think> \\boxed{3}", "<think>", "</think>")
    assert format_think(ctx_of(["<think>a</think>\\boxed{1}", "no"]), {}) == [1.0, 0.0]


def test_format_spawn_blocks():
    good = (
        "search <Calling Sub Searches>\n<Start Sub Search 1 at level 1> Moving to Node #0-1\n"
        "<Start Sub Search 2 at level 1> Moving to Node #0-2\n<End Calling Sub Searches>\n"
        "<Sub Searches Returned>\n<Result of Sub Search 1> No solution\n<Result of Sub Search 2> 3+4=7\n"
        "<End Sub Searches Returned> done"
    )
    assert spawn_ok(good)
    assert spawn_ok("plain sequential search")
    assert not spawn_ok(good.replace("<Result of Sub Search 2> 3+4=7\n", ""))  # a child never returned
    assert not spawn_ok(good.replace("<End Calling Sub Searches>", ""))
    assert not spawn_ok(good.replace("Sub Search 2 at", "Sub Search 3 at"))
    assert format_spawn(ctx_of([good, "<Calling Sub Searches>"]), {}) == [1.0, 0.0]
    # a join_child template with literal braces ({{ }}) renders single braces into the text
    from dataclasses import replace

    from loom.formats import DEFAULT_SPAWN

    braced = replace(DEFAULT_SPAWN, join_child="<Result {{child}} {i}> {message}")
    text = good.replace("<Result of Sub Search 1>", "<Result {child} 1>").replace(
        "<Result of Sub Search 2>", "<Result {child} 2>"
    )
    assert spawn_ok(text, braced)


# ---------------------------------------------------------------- efficiency (AdaSR eq. 7)


def test_efficiency_eq7_hand_computed():
    # L^S=10, L^D=20, alpha=0.5, tau=20: (1-e^-1)(1-e^-0.5) e^-(5+20)/20
    expected = (1 - math.exp(-1)) * (1 - math.exp(-0.5)) * math.exp(-25 / 20)
    assert r_eff(1, 1, 1, 10, 20, 0.5, 20) == pytest.approx(expected)
    assert r_eff(0, 1, 1, 10, 20, 0.5, 20) == 0.0
    assert r_eff(1, 1, 0, 10, 20, 0.5, 20) == 0.0
    assert r_eff(1, 1, 1, 0, 20, 0.5, 20) == 0.0  # lower-bound gate: no streaming reasoning


def test_efficiency_component_uses_group_mean_tau_and_gates():
    t = Trajectory(
        id="t0",
        group_id="g",
        completion_ids=list(range(40)),
        text=STREAM_OK,
        segments=[
            Segment(kind="stream", start=0, end=10),
            Segment(kind="stream", start=10, end=12),
            Segment(kind="deep", start=12, end=32),
            Segment(kind="answer", start=32, end=40),
        ],
    )
    u = t.model_copy(
        update={
            "id": "t1",
            "completion_ids": list(range(20)),
            "segments": t.segments[:2]
            + [Segment(kind="deep", start=12, end=15), Segment(kind="answer", start=15, end=20)],
        }
    )
    ctx = ctx_of(trajs=[t, u], correct=[1.0, 0.0])
    tau = (40 + 20) / 2
    out = efficiency(ctx, {"alpha": 0.5})
    assert out[0] == pytest.approx(r_eff(1, 1, 1, 12, 20, 0.5, tau))
    assert out[1] == 0.0
    assert efficiency(ctx, {"tau": 10.0})[0] == pytest.approx(r_eff(1, 1, 1, 12, 20, 0.5, 10.0))


# ---------------------------------------------------------------- reflection (REA-RL eq. 3)


def test_reflection_clustering_59_characters():
    kw = ["wait", "alternatively", "check", "but"]
    assert count_reflections("Wait, but check this.", kw) == 1  # one run
    assert count_reflections("wait" + " " * 55 + "wait", kw) == 1  # starts 59 apart: same run
    assert count_reflections("wait" + " " * 56 + "wait", kw) == 2  # 60 apart: a new reflection
    chain = "wait" + (" " * 50 + "but") * 5  # each within 59 of the previous: one run
    assert count_reflections(chain, kw) == 1
    assert count_reflections("waiting butter", kw) == 0  # whole words only


def test_reflection_reward_eq3():
    assert reflection_reward(0.0, 0.01) == -1.0
    assert reflection_reward(0.005, 0.01) == pytest.approx(-0.5)
    assert reflection_reward(0.02, 0.01) == 0.0  # never a bonus for reflecting more


def test_reflection_fixed_and_running_quantile():
    text = "<think>" + "step " * 99 + "wait</think> \\boxed{1}"  # 1 reflection / approx tokens of thinking
    ctx = ctx_of([text])
    d = 1 / 100
    assert reflection(ctx, {"fixed_value": 0.02}) == pytest.approx([d / 0.02 - 1])
    stats = DensityStats()
    stats.add("k", [0.001 * i for i in range(1, 101)])  # 0.2-quantile = 0.021
    ctx = ctx_of([text], state=stats)
    assert reflection(ctx, {"d_q": "running", "stat_key": "k", "q": 0.2})[0] == pytest.approx(
        d / 0.021 - 1, rel=0.05
    )


def test_reflection_density_is_in_one_unit_with_or_without_think_tags():
    # with token ids the whole trace is measured in real tokens; the thinking part must be too (it was
    # divided by approximate word tokens instead: the same text scored -0.62 untagged and 0.0 tagged)
    body = "step " * 20 + "wait"
    tagged = Trajectory(id="a", group_id="g", text=f"<think>{body}</think>", completion_ids=[0] * 3000)
    plain = Trajectory(id="b", group_id="g", text=body, completion_ids=[0] * 3000)
    ctx = ctx_of(trajs=[tagged, plain])
    r_tagged, r_plain = reflection(ctx, {"fixed_value": 0.01})
    assert r_plain == pytest.approx(1 / 3000 / 0.01 - 1)
    assert r_tagged < -0.5 and r_tagged == pytest.approx(r_plain, rel=0.2)


def test_zero_variance_group_components_are_constant():
    """All samples alike: every component takes one value across the group (zero advantage)."""
    ctx = ctx_of([STREAM_OK] * 4, correct=[1.0] * 4)
    for fn in (format_stream, format_deep, length_stream, length_deep, length_kimi, efficiency, reflection):
        assert len(set(fn(ctx, {}))) == 1, fn.__name__


# ---------------------------------------------------------------- trace views


def test_last_boxed_is_taken_and_balanced():
    assert last_boxed("first \\boxed{41}, finally \\boxed{\\frac{8}{2}}") == "\\frac{8}{2}"
    assert last_boxed("\\boxed{42} then \\boxed{unclosed") == "42"
    assert answer_region("x" * 1000 + " 42") == ("tail", ("x" * 1000 + " 42")[-300:])


def test_streaming_split_removes_observations():
    v = split_streaming(STREAM_OK)
    assert [p.text.strip() for p in v.stream] == ["a thought", "<ignore>"]
    assert v.deep is not None and v.deep.text.strip() == "deep work"
    assert "\\boxed{4}" in v.answer
