"""The task table: every Celery task a Loom process sends to another, in one place.

A task is named ``<service>.<verb>`` and routed by that prefix to the service's queue
(``loom/queue.py``). Each row says which models its positional arguments and its result are, so a
sender dumps and a worker parses the same types (docs/architecture.md "Contracts"); a ``None``
argument model is a plain JSON value the worker validates itself (its model lives in the service that
owns it, as ``reward_svc/match.py``'s ``MatchRequest``). Senders publish through
``loom.queue.publish`` and workers register through ``loom.queue.task_of``: the names are written
here and nowhere else (``tests/queue/test_task_table.py`` checks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from loom.contracts import wire
from loom.contracts.envs import EnvOpened, EnvStep, EnvStepRequest, EnvTask
from loom.contracts.sandbox import BatchRequest, BatchResult, CellsRequest, CellsResult
from loom.contracts.settings import SERVICES


@dataclass(frozen=True)
class TaskDef:
    """One task: its name, the models of its positional arguments and of its result (None: plain
    JSON the worker validates)."""

    name: str
    args: tuple[type[BaseModel] | None, ...] = ()
    result: type[BaseModel] | None = None

    @property
    def service(self) -> str:
        """The service whose queue takes it (the name's prefix)."""
        return self.name.split(".", 1)[0]

    def __post_init__(self) -> None:
        if self.service not in SERVICES:
            raise ValueError(f"task {self.name!r}: {self.service!r} is not a service ({SERVICES})")


GENERATE_GROUP = TaskDef("rollout.generate_group", (wire.RolloutRequest,), wire.Group)
LOAD_POLICY = TaskDef("rollout.load_policy")  # keyword arguments: version, path, kind
SCORE_GROUP = TaskDef("reward.score_group", (wire.Group, wire.RewardSpec), wire.RewardResult)
# several groups in one task, each result stored under its member's own key: [[key, group, spec], ...]
SCORE_GROUPS = TaskDef("reward.score_groups", (None,))
MATCH_TEXTS = TaskDef("reward.match_texts", (None,))  # reward_svc.match.MatchRequest -> MatchResponse
# /v1/reflect over the queue
REVISE_GROUP = TaskDef("reflect.revise_group", (wire.Group, wire.ReflectParams), wire.Group)
# the RL step's reflection stages (gateway/step.py): cut -> generate the revisions -> assemble -> score;
# the cut's third argument: the gold detector's verdicts, [bool]
CUT_GROUP = TaskDef("reflect.cut_group", (wire.Group, wire.ReflectParams, None), wire.RevisionPlan)
ASSEMBLE_GROUP = TaskDef(
    "reflect.assemble_group", (wire.Group, wire.ReflectParams, wire.RevisionPlan, None), wire.Group
)
TRAIN_STEP = TaskDef("learner.train_step", (wire.TrainBatch,), wire.StepResult)
SCORE_ATTENTION = TaskDef("learner.score_attention")  # keyword arguments: token_ids, steps, delta, zero_from
SANDBOX_RUN_BATCH = TaskDef("sandbox.run_batch", (BatchRequest,), BatchResult)
# cells in order in one fresh interpreter session of the worker, closed at the end (docs/sandbox.md)
SANDBOX_RUN_CELLS = TaskDef("sandbox.run_cells", (CellsRequest,), CellsResult)
# the environment tier (docs/environments.md): open on the shared ``env`` queue; the answer names the
# queue of the worker holding the episode, where its steps and its close (argument: the handle) go
ENV_OPEN = TaskDef("env.open", (EnvTask,), EnvOpened)
ENV_STEP = TaskDef("env.step", (EnvStepRequest,), EnvStep)
ENV_CLOSE = TaskDef("env.close", (None,))


def ping(service: str) -> TaskDef:
    """Every service's liveness round trip through its own queue (``loom.queue`` registers it)."""
    return TaskDef(f"{service}.ping")


TASKS: dict[str, TaskDef] = {
    t.name: t
    for t in (
        GENERATE_GROUP,
        LOAD_POLICY,
        SCORE_GROUP,
        SCORE_GROUPS,
        MATCH_TEXTS,
        REVISE_GROUP,
        CUT_GROUP,
        ASSEMBLE_GROUP,
        TRAIN_STEP,
        SCORE_ATTENTION,
        SANDBOX_RUN_BATCH,
        SANDBOX_RUN_CELLS,
        ENV_OPEN,
        ENV_STEP,
        ENV_CLOSE,
        *(ping(s) for s in SERVICES),
    )
}
