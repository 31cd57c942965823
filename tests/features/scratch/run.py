"""Runs the three scratch features through the product's path, in a process of its own (the table
lines must be in place before the wire models are built): ``python -m tests.features.scratch.run
<tmp dir>`` prints one JSON object of what happened (tests/features/test_one_registration.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from tests.features.scratch import contracts

HERE = Path(__file__).resolve().parent


def install() -> None:
    """The table lines, and the three files where the product looks for a feature by its name."""
    contracts.register()
    import learner.estimators
    import reward_svc
    import rollout_svc.modes

    learner.estimators.__path__.append(str(HERE / "estimators"))
    rollout_svc.modes.__path__.append(str(HERE / "modes"))
    reward_svc.__path__.append(str(HERE / "rewards"))


def refusals() -> dict[str, str]:
    """Each feature's params are checked by its own model, at the same places as the built-ins'."""
    from loom.contracts.modes import ModeError, parse_mode_params
    from loom.contracts.rewards import RequestError, check_spec
    from loom.contracts.wire import RewardComponent, RewardSpec, RolloutRequest, TrainBatch

    out = {}
    try:
        parse_mode_params(RolloutRequest(prompt="p", mode="scratch", mode_params={"rounds": 9}))
    except ModeError as exc:
        out["mode"] = str(exc)
    try:
        TrainBatch(step=0, estimator="scratch", estimator_params={"scael": 2.0})
    except ValueError as exc:
        out["estimator"] = str(exc)
    try:
        check_spec(RewardSpec(components=[RewardComponent(name="scratch", params={"bonus": "x"})]))
    except RequestError as exc:
        out["component"] = repr(exc.loc)
    return out


def posed() -> dict[str, Any]:
    """The built-in dataset and ``loom demo`` pose the scratch mode from its table line alone: the
    tiny model's plain prompts (the default ``BUILTIN_FORMAT``), a demo run of it with accuracy as
    its reward, which the gateway's run model accepts."""
    from gateway.datasets import builtin_items
    from gateway.models import DatasetSpec, RunRequest
    from launch.demo import MODES, parse_args, run_request

    items = builtin_items(DatasetSpec(builtin="arith", size=2, seed=0), "scratch")
    body = run_request(parse_args(["--mode", "scratch", "--steps", "1"]))
    run = RunRequest.model_validate(body)
    return {
        "dataset_prompts": [item.prompt for item in items],
        "dataset_mode_params": [item.mode_params for item in items],
        "demo_lists_it": "scratch" in MODES,
        "demo_run": {"mode": run.mode, "reward": [c.name for c in run.reward.components]},
    }


async def step(tmp: Path) -> dict[str, Any]:
    from launch.inprocess import InProcessStages
    from learner.config import LearnerSettings
    from learner.train import Learner
    from loom.contracts.wire import RewardComponent, RewardSpec, RolloutRequest, SamplingParams, TrainBatch
    from rollout_svc.engines.torch import TorchEngine
    from zoo.tiny import CHECKPOINT_DIR

    engine = TorchEngine(CHECKPOINT_DIR, device="cpu")
    learner = Learner(LearnerSettings(model=CHECKPOINT_DIR, store=tmp / "store", token_budget=256))
    stages = InProcessStages(engine, learner)
    try:
        sampling = SamplingParams(n=2, max_tokens=32, temperature=1.0, seed=0)
        request = RolloutRequest(
            prompt="Compute 2+3.",
            task="arithmetic",
            label="5",
            mode="scratch",
            mode_params={"rounds": 3},
            sampling=sampling,
        )
        group = await stages.generate("scratch-g", request)
        spec = RewardSpec(components=[RewardComponent(name="scratch", params={"bonus": 2.0})])
        scored = await stages.score("scratch-r", group, spec)
        batch = TrainBatch(
            step=0, groups=[group], rewards=[scored], estimator="scratch", estimator_params={"scale": 3.0}
        )
        result = await stages.train("scratch-t", batch)
    finally:
        stages.close()
    from learner.estimators.scratch import CALLS  # type: ignore[import-not-found]

    return {
        "group_mode": group.mode,
        "trajectories": len(group.trajectories),
        "rewards": [r.total for r in scored.rewards],
        "completion_tokens": [len(t.completion_ids) for t in group.trajectories],
        "calls": CALLS,
        "policy_version": result.policy_version,
        "samples": result.metrics.get("samples"),
        "adv_abs_mean": result.metrics.get("adv_abs_mean"),
    }


if __name__ == "__main__":
    install()
    report = {"refusals": refusals(), "posed": posed(), **asyncio.run(step(Path(sys.argv[1])))}
    print(json.dumps(report))
