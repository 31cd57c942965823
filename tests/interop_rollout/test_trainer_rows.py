"""The one rule the four trainer adapters share for a group's rows (loom/clients/trainer_rows.py)."""

from __future__ import annotations

import pytest

from loom.clients.rollouts import RolloutGroup
from loom.clients.trainer_rows import check_tree_initial, pick_leaves, trainer_mode_params, trainer_samples
from loom.contracts.wire import Group, Trajectory


def _group(*ids: tuple[str, str | None]) -> RolloutGroup:
    trajs = [Trajectory(id=tid, group_id="g", completion_ids=[1], parent_id=parent) for tid, parent in ids]
    return RolloutGroup.from_event({"index": 0, "group": Group(id="g", trajectories=trajs), "rewards": None})


TREE = _group(("r0", None), ("r1", None), ("r2", None), ("r1.b0", "r1"), ("r1.b1", "r1"), ("r2.b0", "r2"))


def test_pick_leaves_keeps_whole_subtrees_first() -> None:
    assert [s.id for s in pick_leaves(TREE, 4, "subtree")] == ["r1", "r1.b0", "r1.b1", "r2"]
    assert [s.id for s in pick_leaves(TREE, 6, "subtree")] == ["r1", "r1.b0", "r1.b1", "r2", "r2.b0", "r0"]
    with pytest.raises(ValueError, match="6 leaves, fewer than 7 rows"):
        pick_leaves(TREE, 7, "subtree")


def test_spread_takes_the_expanded_subtrees_in_turns() -> None:
    assert pick_leaves(TREE, 5) == pick_leaves(TREE, 5, "subtree") != pick_leaves(TREE, 5, "spread")
    assert [s.id for s in pick_leaves(TREE, 4, "spread")] == ["r1", "r2", "r1.b0", "r2.b0"]
    assert [s.id for s in pick_leaves(TREE, 6, "spread")] == ["r1", "r2", "r1.b0", "r2.b0", "r1.b1", "r0"]
    assert [s.id for s in trainer_samples(TREE, "tree", 3, leaves="spread")] == ["r1", "r2", "r1.b0"]
    with pytest.raises(ValueError, match="6 leaves, fewer than 7 rows"):
        pick_leaves(TREE, 7, "spread")


def test_trees_keep_leaves_and_the_other_modes_their_roots() -> None:
    assert [s.id for s in trainer_samples(TREE, "tree", 4)] == ["r1", "r1.b0", "r1.b1", "r2"]
    spawn = _group(("a", None), ("b", None), ("a.c0", "a"), ("a.c1", "a"))  # children have their own prompts
    assert [s.id for s in trainer_samples(spawn, "spawn", 2)] == ["a", "b"]
    with pytest.raises(ValueError, match="2 samples for 3 rows"):
        trainer_samples(spawn, "spawn", 3)
    with pytest.raises(ValueError, match="2 samples for 1 rows"):
        trainer_samples(spawn, "spawn", 1)  # exact by default: a group of another size is an error
    assert [s.id for s in trainer_samples(spawn, "spawn", 1, exact=False)] == ["a"]


def test_a_dropped_prompt_and_a_small_tree_are_refused() -> None:
    dropped = RolloutGroup.from_event({"index": 3, "group": None, "rewards": None})
    with pytest.raises(ValueError, match="prompt 3 came back without a group"):
        trainer_samples(dropped, "plain", 2)
    with pytest.raises(ValueError, match=r"initial=2 < num_generations=4: too few leaves"):
        check_tree_initial("tree", {"initial": 2}, 4, "num_generations")
    check_tree_initial("tree", {"initial": 4}, 4, "num_generations")  # enough: no error
    check_tree_initial("tree", {}, 4, "num_generations")  # the mode's default is checked by the mode
    check_tree_initial("plain", {"initial": 1}, 4, "num_generations")  # only trees have leaves


def test_each_adapter_refuses_streamings_group_positions_when_it_is_built() -> None:
    from loom.clients.openrlhf_rollout import LoomAgentExecutor
    from loom.clients.slime_rollout import LoomGenerate
    from loom.clients.trl_rollout import LoomRolloutFunc
    from loom.contracts.modes import StreamingParams

    group = {"layout": "group_positions"}
    builds = {
        "TRL": lambda p: LoomRolloutFunc("http://127.0.0.1:9", mode="streaming", mode_params=p),
        "slime": lambda p: LoomGenerate("http://127.0.0.1:9", mode="streaming", mode_params=p),
        "OpenRLHF": lambda p: LoomAgentExecutor(
            "http://127.0.0.1:9", n_samples_per_prompt=2, mode="streaming", mode_params=p
        ),
    }
    for trainer, build in builds.items():  # verl's: verl_side_checks.py, refused before any job
        for params in (group, StreamingParams(layout="group_positions", context="A text.")):
            with pytest.raises(ValueError, match=f"'group_positions' has no {trainer} form"):
                build(params)
        build({"layout": "interleaved"})  # the layout each trainer holds is built
    assert trainer_mode_params("plain", None, "TRL") == {}
    assert trainer_mode_params("tree", {"initial": 4}, "TRL") == {"initial": 4}
