"""Tree mode with process scores end to end (docs/algorithms.md §5.4): the torch engine on the tiny model
grows a tree-mode group, the in-process stages' reward core scores it with ``accuracy`` and the
``process`` component (steps = the tree's node segments) against a real PRM server, and the learner
trains it with the ``treerl`` estimator and a process weight: every node gets its segment's PRM
score, the weight moves the advantages, the rollouts client gives a trainer those advantages, and
the step publishes a version."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from loom.clients.judge import JudgeClient
from loom.contracts.reward_settings import JudgeServer
from loom.contracts.wire import RewardComponent, RewardSpec, RolloutRequest, SamplingParams, TrainBatch
from tests.reflect.reflect_helpers import serve
from tests.reward.test_process import Prm


@pytest.fixture(scope="module")
def prm_url() -> Iterator[str]:
    with serve(Prm().app) as url:
        yield url


def test_tree_group_with_process_scores_trains(
    prm_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOOM_DATA_DIR", str(tmp_path / "data"))
    from launch.inprocess import InProcessStages, Scorer
    from learner.assign import assign_batch
    from learner.config import LearnerSettings
    from learner.train import Learner
    from loom.clients.rollouts import RolloutGroup
    from loom.runtime import configure_process
    from loom.treerl import node_process_scores
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR, make_problems, reflect_prompt

    configure_process()
    problem = make_problems("arith", 1, seed=1)[0]
    request = RolloutRequest(
        mode="tree",
        prompt=reflect_prompt(problem),
        sampling=SamplingParams(max_tokens=64, seed=5),
        task="arithmetic",
        label=problem.gold,
        mode_params={"initial": 2, "delta": 2, "min_distance": 4, "strategy": "entropy"},
    )
    engine = TorchEngine(CHECKPOINT_DIR, device="cpu")
    learner = Learner(LearnerSettings(model=CHECKPOINT_DIR, store=tmp_path / "store", token_budget=512))
    client = JudgeClient({"p": JudgeServer(url=prm_url, model="ok")})
    stages = InProcessStages(engine, learner, Scorer(judges=client))
    try:
        group = asyncio.run(stages.generate("tree-g", request))
        assert group.tree and len(group.trajectories) > 2
        spec = RewardSpec(
            components=[
                RewardComponent(name="accuracy"),
                RewardComponent(name="process", weight=0.0, params={"prm": "p", "steps": "segments"}),
            ]
        )
        scored = asyncio.run(stages.score("tree-s", group, spec))
        # the PRM answered every step (the tiny model's answers may be wrong: accuracy's status is its own)
        assert all(not r.status.startswith("prm_") and r.steps for r in scored.rewards)
        steps = {
            r.trajectory_id: [(s.start, s.end, s.score) for s in (r.steps or {})["process"]]
            for r in scored.rewards
        }
        nodes = [n for n in group.tree if n.end > n.start]
        assert set(node_process_scores(nodes, steps)) == {n.id for n in nodes}  # each node its step's score
        # a shared prefix is one request: at most one per node, fewer than the paths' steps
        total = sum(len(v) for v in steps.values())
        print(
            f"tree: {len(group.trajectories)} paths, {len(nodes)} nodes, {total} steps, {client.sent} asked"
        )
        assert client.sent <= len(nodes) < total
        params = {"process_weight": 0.5}
        batch = TrainBatch(
            step=0, groups=[group], rewards=[scored], estimator="treerl", estimator_params=params
        )
        plain = TrainBatch(step=0, groups=[group], rewards=[scored], estimator="treerl")
        mixed = [s.adv for s in assign_batch(batch, drop_zero=False).samples]
        assert mixed != [s.adv for s in assign_batch(plain, drop_zero=False).samples]  # the weight acts
        # the trainer-facing client, given the same estimator parameters, gives the learner's numbers
        event = {"index": 0, "group": group, "rewards": scored}
        trainer = RolloutGroup.from_event(event, treerl=params)
        by_traj = {s.trajectory.id: s.adv for s in assign_batch(batch, drop_zero=False).samples}
        assert {s.id: s.advantages for s in trainer.samples} == by_traj
        result = asyncio.run(stages.train("tree-t", batch))
    finally:
        stages.close()
    assert result.policy_version == 1 and result.metrics["samples"] > 0
