"""Estimators against hand-computed examples (docs/algorithms.md §5.1)."""

from __future__ import annotations

import math

import pytest

from learner import estimators as est
from learner.estimators import assign_group
from loom.contracts.wire import Group, PoolStats, ThreadLink, Trajectory, TrajectoryReward, TreeNode

approx = pytest.approx


def test_grpo_normalises_by_group_mean_and_population_std():
    # mean 0.5, std 0.5 -> +-1
    assert est.grpo([1, 0, 0, 1]) == approx([1, -1, -1, 1], abs=1e-5)
    # mean 1, std sqrt(2/3)
    s = math.sqrt(2 / 3)
    assert est.grpo([0, 1, 2]) == approx([-1 / s, 0, 1 / s], abs=1e-5)


def test_dr_grpo_subtracts_mean_only():
    assert est.dr_grpo([1, 0, 0, 0]) == approx([0.75, -0.25, -0.25, -0.25])


@pytest.mark.parametrize("fn", [est.grpo, est.dr_grpo, est.rea])
def test_single_sample_and_zero_variance_give_zero(fn):
    assert fn([1.0]) == [0.0]
    assert fn([0.7, 0.7, 0.7]) == [0.0, 0.0, 0.0]
    assert fn([]) == []


def test_global_baseline_uses_every_response_sampled_over_rounds():
    # Reinforce-Ada: round 1 draws 8 all-wrong responses, round 2 draws 8 with one right.
    rounds = [[0.0] * 8, [1.0] + [0.0] * 7]
    pool = PoolStats(n_sampled=0, rounds=0)
    for r in rounds:
        pool = PoolStats(
            n_sampled=pool.n_sampled + len(r),
            reward_sum=pool.reward_sum + sum(r),
            reward_sq_sum=pool.reward_sq_sum + sum(x * x for x in r),
            n_positive=pool.n_positive + sum(1 for x in r if x > 0.7),
            rounds=pool.rounds + 1,
        )
    kept = [1.0, 0.0, 0.0, 0.0]  # balanced down-sampling kept the positive
    assert est.global_baseline(kept, pool) == approx([15 / 16, -1 / 16, -1 / 16, -1 / 16])
    # the kept group's own mean would be 0.25: the pool baseline differs
    assert est.dr_grpo(kept) != approx(est.global_baseline(kept, pool))
    # optional std: pool var = 1/16 - 1/256 = 15/256
    assert est.global_baseline(kept, pool, std=True)[0] == approx(math.sqrt(15), rel=1e-5)
    # no pool -> the kept group is the pool
    assert est.global_baseline(kept, None) == approx([0.75, -0.25, -0.25, -0.25])


def _hrpo_components():
    return [
        {
            "accuracy": 1,
            "format_stream": 1,
            "format_deep": 1,
            "length_stream": -1,
            "length_deep": -2,
            "efficiency": 0.5,
        },
        {
            "accuracy": 0,
            "format_stream": 1,
            "format_deep": 1,
            "length_stream": -2,
            "length_deep": -2,
            "efficiency": 0.0,
        },
        {
            "accuracy": 0,
            "format_stream": 0,
            "format_deep": 1,
            "length_stream": -5,
            "length_deep": -3,
            "efficiency": 0.0,
        },
        {
            "accuracy": 1,
            "format_stream": 1,
            "format_deep": 1,
            "length_stream": -3,
            "length_deep": -1,
            "efficiency": 0.25,
        },
    ]


def test_global_baseline_refuses_a_reward_key_its_pool_was_not_summed_over():
    # the pool's sums are of the total reward; centring another component on them is silently wrong
    tr = [Trajectory(id=f"t{i}", group_id="g", prompt_ids=[1], completion_ids=[2]) for i in range(2)]
    rw = {
        "t0": TrajectoryReward(trajectory_id="t0", total=3.0, components={"accuracy": 1.0}),
        "t1": TrajectoryReward(trajectory_id="t1", total=0.0, components={"accuracy": 0.0}),
    }
    group = Group(id="g", trajectories=tr, pool=PoolStats(n_sampled=2, reward_sum=3.0, reward_sq_sum=9.0))
    with pytest.raises(ValueError, match="reward_key must be 'total'"):
        assign_group(group, rw, "global_baseline", {"reward_key": "accuracy"})
    out = assign_group(group, rw, "global_baseline", {"reward_key": "total"})
    assert [s.adv[0] for s in out] == approx([1.5, -1.5])


def test_hrpo_hand_computed_components():
    h = est.hrpo(_hrpo_components(), beta=0.05, w_acc=1.0, w_fmt=2.0)
    # N(fmt_s) of [1,1,0,1]: mean .75, std sqrt(3)/4
    n_fs = [1 / math.sqrt(3), 1 / math.sqrt(3), -math.sqrt(3), 1 / math.sqrt(3)]
    # length_stream masked by format: only members 0,1,3 -> [-1,-2,-3], std sqrt(2/3); member 2 gets 0
    s = math.sqrt(2 / 3)
    n_ls = [1 / s, 0.0, 0.0, -1 / s]
    # fmt_d has zero variance -> 0; length_deep [-2,-2,-3,-1]: mean -2, std sqrt(.5)
    n_ld = [0.0, 0.0, -1 / math.sqrt(0.5), 1 / math.sqrt(0.5)]
    # acc [1,0,0,1] -> +-1; eff [.5,0,0,.25]: mean .1875, std sqrt(.04296875)
    sd = math.sqrt(0.04296875)
    n_eff = [(0.5 - 0.1875) / sd, -0.1875 / sd, -0.1875 / sd, (0.25 - 0.1875) / sd]
    n_acc = [1, -1, -1, 1]
    for i, hi in enumerate(h):
        assert hi.adv_stream == approx(2 * n_fs[i] + 0.05 * n_ls[i], abs=1e-4)
        assert hi.adv_deep == approx(0.05 * n_ld[i], abs=1e-4)
        assert hi.adv_global == approx(n_acc[i] + 0.05 * n_eff[i], abs=1e-4)


def test_hrpo_beta_acts_after_normalisation():
    comps = _hrpo_components()
    base = est.hrpo(comps, beta=0.05)
    # scaling a length reward (a reward-level beta) cancels in N_G: same advantages
    scaled = [{**c, "length_deep": 10 * c["length_deep"]} for c in comps]
    assert [h.adv_deep for h in est.hrpo(scaled, beta=0.05)] == approx([h.adv_deep for h in base], rel=1e-5)
    # the advantage-level beta does not cancel: doubling it doubles the length part
    double = est.hrpo(comps, beta=0.1)
    assert [h.adv_deep for h in double] == approx([2 * h.adv_deep for h in base])


def test_hrpo_length_unmasked_option_and_custom_names():
    comps = [{"acc": 1.0, "ls": -1.0, "fs": 1.0}, {"acc": 0.0, "ls": -3.0, "fs": 0.0}]
    names = est.HrpoNames(accuracy="acc", length_stream="ls", format_stream="fs")
    h = est.hrpo(comps, beta=1.0, w_fmt=1.0, mask_length_by_format=False, names=names)
    assert [x.adv_global for x in h] == approx([1, -1], abs=1e-5)
    assert [x.adv_stream for x in h] == approx([2, -2], abs=1e-5)  # N(fs) + N(ls)
    masked = est.hrpo(comps, beta=1.0, w_fmt=1.0, names=names)
    assert [x.adv_stream for x in masked] == approx([1, -1], abs=1e-5)  # length: one valid member -> 0


def _tree_group():
    base = list(range(10, 18))  # t1: 8 tokens, split into a1 [0,4) and a2 [4,8)
    trajs = [
        Trajectory(id="t1", group_id="q", prompt_ids=[1], completion_ids=base),
        Trajectory(id="t2", group_id="q", prompt_ids=[1], completion_ids=[30, 31, 32]),
        Trajectory(id="t3", group_id="q", prompt_ids=[1], completion_ids=base[:4] + [40, 41, 42, 43, 44]),
        Trajectory(id="t4", group_id="q", prompt_ids=[1] + base[:4], completion_ids=[50, 51, 52]),
    ]
    tree = [
        TreeNode(id="a1", parent=None, trajectory_id="t1", start=0, end=4),
        TreeNode(id="a2", parent="a1", trajectory_id="t1", start=4, end=8),
        TreeNode(id="b1", parent=None, trajectory_id="t2", start=0, end=3),
        TreeNode(id="a3", parent="a1", trajectory_id="t3", start=4, end=9),
        TreeNode(id="a4", parent="a1", trajectory_id="t4", start=0, end=3),  # prefix in its prompt
    ]
    rewards = {
        "t1": TrajectoryReward(trajectory_id="t1", total=1, components={"accuracy": 1}),
        "t2": TrajectoryReward(trajectory_id="t2", total=0, components={"accuracy": 0}),
        "t3": TrajectoryReward(trajectory_id="t3", total=0, components={"accuracy": 0}),
        "t4": TrajectoryReward(trajectory_id="t4", total=1, components={"accuracy": 1}),
    }
    return Group(id="q", mode="tree", trajectories=trajs, tree=tree), rewards


def test_treerl_node_values_on_a_small_tree():
    group, rewards = _tree_group()
    adv = est.treerl(group.tree, {k: v.components["accuracy"] for k, v in rewards.items()})
    # V(root) = .5; V(a1) = mean(t1, t3, t4) = 2/3; V(a2) = 1; V(a3) = 0; V(a4) = 1; V(b1) = 0
    assert adv["a1"] == approx((2 * (2 / 3 - 0.5)) / math.sqrt(3))
    assert adv["a2"] == approx((1 - 0.5) + (1 - 2 / 3))
    assert adv["a3"] == approx((0 - 0.5) + (0 - 2 / 3))
    assert adv["a4"] == approx((1 - 0.5) + (1 - 2 / 3))
    assert adv["b1"] == approx((0 - 0.5) + (0 - 0.5))


def test_treerl_assigns_node_advantages_per_segment():
    group, rewards = _tree_group()
    out = {s.trajectory.id: s.adv for s in assign_group(group, rewards, "treerl", {})}
    a1 = (2 * (2 / 3 - 0.5)) / math.sqrt(3)
    assert out["t1"] == approx([a1] * 4 + [0.5 + 1 / 3] * 4)
    # t3 repeats t1's first 4 tokens at the same offsets: they carry a1's advantage
    assert out["t3"] == approx([a1] * 4 + [-0.5 - 2 / 3] * 5)
    assert out["t4"] == approx([0.5 + 1 / 3] * 3)  # its prefix is prompt, only a4 is trained here
    assert out["t2"] == approx([-1.0] * 3)


def test_rea_normalises_originals_and_kept_revisions_together():
    trajs = [
        Trajectory(id="o1", group_id="q", prompt_ids=[1], completion_ids=[2, 3]),
        Trajectory(id="o2", group_id="q", prompt_ids=[1], completion_ids=[2]),
        Trajectory(id="r1", group_id="q", prompt_ids=[1], completion_ids=[2], parent_id="o1"),
    ]
    rewards = {
        "o1": TrajectoryReward(trajectory_id="o1", total=1.0),
        "o2": TrajectoryReward(trajectory_id="o2", total=0.0),
        "r1": TrajectoryReward(trajectory_id="r1", total=1.0),
    }
    out = assign_group(Group(id="q", trajectories=trajs), rewards, "rea", {})
    s = math.sqrt(2 / 9)  # rewards [1, 0, 1]: mean 2/3
    assert [x.adv[0] for x in out] == approx([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s], abs=1e-4)


def test_apr_gives_every_call_its_rollouts_advantage_and_per_call_weight():
    trajs = [
        Trajectory(id="r1", group_id="q", prompt_ids=[1], completion_ids=[5, 6]),
        Trajectory(id="c1", group_id="q", prompt_ids=[1], completion_ids=[7]),
        Trajectory(id="c2", group_id="q", prompt_ids=[1], completion_ids=[8], parent_id="r1"),
        Trajectory(id="r2", group_id="q", prompt_ids=[1], completion_ids=[9]),
    ]
    group = Group(id="q", mode="spawn", trajectories=trajs, threads=[ThreadLink(parent="r1", child="c1")])
    rewards = {
        "r1": TrajectoryReward(trajectory_id="r1", total=1.0),
        "r2": TrajectoryReward(trajectory_id="r2", total=0.0),
    }
    out = {s.trajectory.id: s for s in assign_group(group, rewards, "apr", {})}
    for tid in ("r1", "c1", "c2"):
        assert out[tid].adv[0] == approx(1.0, abs=1e-5)
        assert out[tid].weight == approx(1 / 3)
    assert out["r2"].adv == approx([-1.0], abs=1e-5)
    assert out["r2"].weight == 1.0


def test_hrpo_token_assignment_follows_segments_and_masks_observations():
    trajs = [
        Trajectory(
            id=f"t{i}",
            group_id="q",
            prompt_ids=[1],
            completion_ids=[2] * 7,
            loss_mask=[1, 1, 0, 1, 1, 1, 1],
            segments=[
                {"kind": "stream", "start": 0, "end": 2},
                {"kind": "observation", "start": 2, "end": 3},
                {"kind": "stream", "start": 3, "end": 4},
                {"kind": "deep", "start": 4, "end": 6},
                {"kind": "answer", "start": 6, "end": 7},
            ],
        )
        for i in range(2)
    ]
    comps = [{"accuracy": 1, "format_stream": 1}, {"accuracy": 0, "format_stream": 0}]
    rewards = {
        f"t{i}": TrajectoryReward(trajectory_id=f"t{i}", total=0, components=comps[i]) for i in range(2)
    }
    out = assign_group(Group(id="q", trajectories=trajs), rewards, "hrpo", {"w_fmt": 1.0})
    t0 = out[0]
    assert t0.mask == [1, 1, 0, 1, 1, 1, 1]
    assert t0.stream_mask == [1, 1, 0, 1, 0, 0, 0]
    assert t0.adv == approx([1, 1, 0, 1, 1, 1, 1], abs=1e-5)  # A^g on every trained token
    assert t0.adv_stream == approx([1, 1, 0, 1, 0, 0, 0], abs=1e-5)
    assert t0.adv_deep == [0.0] * 7  # format_deep absent: zero everywhere
