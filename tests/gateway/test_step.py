"""The one RL step (gateway/step.py) through its two transports: the product's Celery stages over a
real broker with the real rollout, reward and reflect workers, and the in-process stages of the
benches (launch/inprocess.py), on the tiny model. The same seeded step gives the same TrainBatch; with
reflection a group costs at most two reward calls; the run's reflection params decide the revisions."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from gateway import step as rl
from gateway.models import RunRequest
from gateway.pipeline import CeleryStages
from launch.inprocess import InProcessStages
from loom.contracts.wire import (
    Group,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    SamplingParams,
    TrainBatch,
)
from zoo.tiny import tiny_problems
from zoo.tiny.traces import reflect_prompt

# the revision's knobs differ from ReflectParams' defaults (min_chunk_tokens 32, max_tokens 256): a
# transport that dropped them would cut elsewhere and complete longer
REFLECT = {"detector": "gold", "min_chunk_tokens": 8, "max_tokens": 24}
SPEC = {"components": [{"name": "accuracy"}, {"name": "length_refined"}]}


def run_request(reflect: Any = REFLECT) -> RunRequest:
    """The run whose step is under test: its reward spec and reflection params are what reach the
    stages (``StepConfig.of``, as gateway/runs.py builds its step)."""
    return RunRequest.model_validate(
        {
            "dataset": {"builtin": "arith", "size": 8},
            "reward": SPEC,
            "estimator": "rea",
            "reflect": reflect,
            "sampling": {"n": 4, "temperature": 1.0, "max_tokens": 96, "seed": 11},
        }
    )


def draw(req: RunRequest, prompts: int = 3) -> Callable[[int], list[RolloutRequest]]:
    def requests(batch: int) -> list[RolloutRequest]:
        problems = tiny_problems("arith", prompts, 7 + batch, "train")
        sampling = SamplingParams.model_validate(req.sampling.model_dump())
        return [
            RolloutRequest(
                mode="plain",
                prompt=reflect_prompt(p),
                label=p.gold,
                task="arithmetic",
                sampling=sampling.model_copy(update={"seed": (sampling.seed or 0) + 17 * i}),
            )
            for i, p in enumerate(problems)
        ]

    return requests


class Counting:
    """Counts the reward service's calls (scores and gold matches) per group, around real stages;
    ``serial``: one generation at a time, as a rollout worker with one engine slot runs them, so the
    engine's batches (and their float rounding) are the same over both transports."""

    def __init__(self, stages: Any, serial: bool = False) -> None:
        self.stages = stages
        self.reward_calls: Counter[str] = Counter()
        self.serial = asyncio.Lock() if serial else None

    async def generate(self, key: str, request: RolloutRequest) -> Group:
        if self.serial is None:
            return await self.stages.generate(key, request)
        async with self.serial:
            return await self.stages.generate(key, request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)

    async def score(self, key: str, group: Group, spec: RewardSpec) -> RewardResult:
        self.reward_calls[key.rsplit(".", 1)[0]] += 1
        return await self.stages.score(key, group, spec)

    async def match(self, key: str, group: Group, texts: list[str]) -> list[bool]:
        self.reward_calls[key.rsplit(".", 1)[0]] += 1
        return await self.stages.match(key, group, texts)


async def one_step(stages: Any, req: RunRequest, scope: str) -> TrainBatch:
    """The step's generation and the batch it trains (gateway.step, as the run loop calls it)."""
    cfg = rl.StepConfig.of(req)
    collected = await rl.generate_step(stages, cfg, f"{scope}.s0", draw(req), 3, policy_version=0)
    return rl.train_batch(0, rl.trained_groups(collected, cfg, 3), cfg)


def in_process(settings: Any) -> tuple[InProcessStages, Any]:
    """The in-process stages on the engine a rollout worker with ``settings`` builds (in this process,
    with the workers' torch thread count: a reduction over more threads rounds otherwise)."""
    from loom.runtime import set_torch_threads
    from rollout_svc.engines import make_engine

    set_torch_threads(settings.torch_threads)
    engine = make_engine(settings.model_copy(update={"engine_process": False}))
    return InProcessStages(engine), engine


# what a transport adds to a group or a reward and no estimator reads: wall-clock times and the
# worker's delivery record (loom.queue's task shell)
TRANSPORT = {"timing", "score_s", "generated_at", "redelivered", "retries", "worker_pid"}


def close_to(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``a`` and ``b`` (JSON) differ: floats by more than 1e-6 (relative, or absolute below 1:
    the engine in a worker's process and in this one round a float32 log-prob of the same token
    alike to about 1e-6 of it), anything else at all (but the ``TRANSPORT`` fields)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = (set(a) | set(b)) - TRANSPORT
        return [d for k in sorted(keys) for d in close_to(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} != {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in close_to(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6) else [f"{path}: {a} != {b}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.mark.parametrize("broker_env", ["rabbitmq"], indirect=True)
def test_the_same_seeded_step_gives_the_same_batch_over_celery_and_in_process(
    broker_env: Any, loom_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # no prefix cache: which groups share a cached prefix would depend on the order they reach the engine
    broker_env.extra_env.update(LOOM_ENGINE_PREFIX_CACHE_ENTRIES="0")
    workers = [loom_worker(s, broker_env, wait=False) for s in ("rollout", "reward", "reflect")]
    for w in workers:
        w.wait_ready()
    req = run_request()
    # one publisher: the groups reach the rollout queue in the order the step asks for them, the order
    # the in-process stages run them in (the engine's cache shapes follow its history)
    celery = Counting(CeleryStages(broker_env.app("gateway"), timeout=300.0, publishers=1))
    try:
        over_celery = asyncio.run(one_step(celery, req, "celery"))
    finally:
        celery.stages.close()
    broker_env.apply(monkeypatch)  # the in-process engine: the workers' model, device and settings
    stages, engine = in_process(broker_env.settings)
    local = Counting(stages, serial=True)
    try:
        here = asyncio.run(one_step(local, req, "celery"))
    finally:
        stages.close()
        engine.stop_scheduler()
    revisions = [t for g in here.groups for t in g.trajectories if "revision_of" in t.meta]
    assert revisions, "no revision was kept: the comparison would not cover the reflection stages"
    differences = close_to(over_celery.model_dump(mode="json"), here.model_dump(mode="json"))
    assert differences == [], "\n".join(differences)
    # the gold match and one score per group, the same over both transports
    assert celery.reward_calls == local.reward_calls
    assert set(local.reward_calls.values()) <= {1, 2} and 2 in local.reward_calls.values()


@pytest.fixture(scope="module")
def tiny_stages() -> Any:
    from loom.contracts.settings import Settings

    stages, engine = in_process(Settings(model="tiny", device="cpu"))
    yield stages
    stages.close()
    engine.stop_scheduler()


def test_with_reflection_a_group_costs_at_most_two_reward_calls(tiny_stages: Any) -> None:
    counting = Counting(tiny_stages)
    batch = asyncio.run(one_step(counting, run_request(), "count"))
    assert any("revision_of" in t.meta for g in batch.groups for t in g.trajectories)
    # one key per group: the gold detector's match and the revised group's one score
    assert len(counting.reward_calls) == 3 and max(counting.reward_calls.values()) == 2, counting.reward_calls
    for g, r in zip(batch.groups, batch.rewards, strict=True):  # every kept trajectory was scored
        assert [t.id for t in g.trajectories] == [x.trajectory_id for x in r.rewards]


def test_the_runs_reflection_params_decide_the_revisions(tiny_stages: Any) -> None:
    """A run whose ReflectParams remove nothing (``max_removed_fraction`` 0: every cut moves to the end
    of the thinking) keeps no revision; the same run with the default fraction keeps some. Both runs
    sample the same originals."""
    revised = asyncio.run(one_step(tiny_stages, run_request(REFLECT), "half"))
    untouched = asyncio.run(
        one_step(tiny_stages, run_request({**REFLECT, "max_removed_fraction": 0.0}), "none")
    )

    def originals(batch: TrainBatch) -> list[list[int]]:
        return [t.completion_ids for g in batch.groups for t in g.trajectories if "revision_of" not in t.meta]

    assert originals(revised) == originals(untouched)
    assert sum("revision_of" in t.meta for g in revised.groups for t in g.trajectories) > 0
    assert all("revision_of" not in t.meta for g in untouched.groups for t in g.trajectories)
    statuses = {i["status"] for g in untouched.groups for i in g.meta["reflect"]["info"]}
    assert "nothing_to_remove" in statuses and "truncated" not in statuses


def test_reflect_true_is_the_default_params_and_false_none() -> None:
    from loom.contracts.wire import ReflectParams

    assert rl.StepConfig.of(run_request(True)).reflect == ReflectParams()
    assert rl.StepConfig.of(run_request(False)).reflect is None
    assert rl.StepConfig.of(run_request()).reflect == ReflectParams.model_validate(REFLECT)


def test_the_train_batch_is_built_in_one_place_of_the_product() -> None:
    """Runs, jobs and the benches share ``gateway.step.train_batch``: no other product module builds one."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    packages = ("loom", "gateway", "rollout_svc", "reward_svc", "reflect_svc", "learner", "launch")
    builders = [
        str(path.relative_to(repo))
        for package in packages
        for path in (repo / package).rglob("*.py")
        if "TrainBatch(" in path.read_text().replace("class TrainBatch(", "")
    ]
    assert builders == ["gateway/step.py"]


class Recording:
    """Real stages that keep every batch they train."""

    def __init__(self, stages: Any) -> None:
        self.stages = stages
        self.batches: list[TrainBatch] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stages, name)

    async def train(self, key: str, batch: TrainBatch) -> Any:
        self.batches.append(batch)
        return await self.stages.train(key, batch)


def test_a_runs_loop_hands_its_reflection_params_to_reflect(tmp_path: Any) -> None:
    """The gateway's run loop (gateway/runs.py) over the in-process stages and a real learner: the
    run's ``reflect`` params, not ReflectParams' defaults, decide what its trained batch holds."""
    import json

    from gateway.runs import RunLoop
    from gateway.state import GatewayState
    from learner.config import LearnerSettings
    from learner.train import Learner
    from loom.contracts.settings import Settings
    from zoo.registry import resolve_model_path

    problems = tiny_problems("arith", 3, 7, "train")
    jsonl = "".join(json.dumps({"prompt": reflect_prompt(p), "answer": p.gold}) + "\n" for p in problems)

    def trained(reflect: dict[str, Any], name: str) -> TrainBatch:
        body = run_request(reflect).model_dump(mode="json")
        body.update(
            dataset={"jsonl": jsonl, "task": "arithmetic"},
            schedule={"steps": 1, "batch_size": 3, "staleness": 0},
        )
        state = GatewayState(tmp_path / f"{name}.sqlite")
        run_id, _ = state.runs.create(owner="me", request=RunRequest.model_validate(body))
        stages, engine = in_process(Settings(model="tiny", device="cpu"))
        learner = Learner(
            LearnerSettings(model=resolve_model_path("tiny"), store=tmp_path / name, save_optimizer=False)
        )
        stages.learner = learner
        recording = Recording(stages)
        try:
            status = asyncio.run(RunLoop(run_id, state, recording, tmp_path / name).run())  # type: ignore[arg-type]
        finally:
            stages.close()
            engine.stop_scheduler()
        assert status == "succeeded" and len(recording.batches) == 1
        return recording.batches[0]

    revised = trained(REFLECT, "half")
    untouched = trained({**REFLECT, "max_removed_fraction": 0.0}, "none")
    assert sum("revision_of" in t.meta for g in revised.groups for t in g.trajectories) > 0
    assert all("revision_of" not in t.meta for g in untouched.groups for t in g.trajectories)
