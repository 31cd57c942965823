"""SIMPLE STAGE TASKS for gateway tests (not the real services): deterministic Celery tasks registered
under the real task names, so the gateway's orchestration runs over a real broker and real workers.

- ``rollout.generate_group``: n trajectories; trajectory i of group g is "correct" with probability
  p(prompt) drawn from a hash (a simulated pass rate), or never when the prompt contains "impossible";
  ``policy_version`` is the version the request names (as the real rollout loads it from the store),
  or the one last loaded by ``rollout.load_policy`` when that is newer.
- ``reward.score_group``: total 1.0 for a correct trajectory, else 0.0; ``reward.score_groups`` the
  same for several groups, each result stored under its member's key (the gateway's batched form).
- both append "<unix time> <task> <group id>" to ``$LOOM_TEST_TASK_LOG`` (when set) as they START
  their work, so a test can tell which groups were generated or scored after a cancel.
- ``learner.train_step``: appends "<step> <new version>" to ``$LOOM_TEST_STAGE_LOG`` (one line per
  execution, so a step trained twice shows twice), sleeps ``$LOOM_TEST_TRAIN_SECONDS``, returns the
  next policy version.

Start: ``celery -A stage_tasks worker -Q <ns>rollout,<ns>reward`` (cwd = this folder).
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path
from typing import Any

from loom.contracts.wire import (
    Group,
    RewardResult,
    RolloutRequest,
    StepResult,
    TrainBatch,
    Trajectory,
    TrajectoryReward,
)
from loom.queue import make_celery

app = make_celery("rollout")
STATE = Path(os.environ.get("LOOM_TEST_STAGE_LOG", "/tmp/loom-stage.log"))


def _unit(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def _version_file() -> Path:
    return STATE.with_suffix(".version")


def _started(task: str, gid: str) -> None:
    path = os.environ.get("LOOM_TEST_TASK_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{time.time()} {task} {gid}\n")


def _loaded_version() -> int:
    p = STATE.with_suffix(".loaded")
    return int(p.read_text()) if p.exists() else 0


@app.task(name="rollout.generate_group")
def generate_group(request: dict[str, Any]) -> dict[str, Any]:
    req = RolloutRequest.model_validate(request)
    gid = req.group_id or "g"
    _started("generate", gid)
    prompt = req.prompt or ""
    p = 0.0 if "impossible" in prompt else _unit(prompt)
    rng = random.Random(gid)
    trajs = []
    for i in range(req.sampling.n):
        correct = rng.random() < p
        length = rng.randint(3, 9)
        trajs.append(
            Trajectory(
                id=f"t{i}",
                group_id=gid,
                prompt_ids=[1, 2, 3],
                completion_ids=[rng.randrange(100) for _ in range(length)],
                logprobs=[-1.0] * length,
                policy_version=max(_loaded_version(), req.policy_version or 0),
                text="right" if correct else "wrong",
                meta={"correct": correct},
            )
        )
    time.sleep(float(os.environ.get("LOOM_TEST_GEN_SECONDS", "0")))
    return Group(id=gid, prompt=prompt, label=req.label, trajectories=trajs).model_dump(mode="json")


@app.task(name="rollout.load_policy")
def load_policy(version: int | None = None, path: str | None = None, kind: str = "full") -> dict[str, Any]:
    STATE.with_suffix(".loaded").write_text(str(int(version or 0)))
    return {"policy_version": version}


@app.task(name="reward.score_group")
def score_group(group: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    g = Group.model_validate(group)
    _started("score", g.id)
    rewards = [
        TrajectoryReward(
            trajectory_id=t.id,
            total=1.0 if t.meta.get("correct") else 0.0,
            components={"accuracy": 1.0 if t.meta.get("correct") else 0.0},
        )
        for t in g.trajectories
    ]
    return RewardResult(group_id=g.id, rewards=rewards).model_dump(mode="json")


@app.task(name="reward.score_groups", bind=True, ignore_result=True)
def score_groups(self: Any, members: list[list[Any]]) -> None:
    """The gateway's batched reward task: each ``[key, group, spec]`` scored as ``score_group`` and
    stored under its key (a key that has a result already is skipped)."""
    for key, group, spec in members:
        if self.backend.get_task_meta(key).get("status") != "SUCCESS":
            self.backend.store_result(key, score_group(group, spec), "SUCCESS")


@app.task(name="learner.train_step")
def train_step(batch: dict[str, Any]) -> dict[str, Any]:
    b = TrainBatch.model_validate(batch)
    vf = _version_file()
    version = (int(vf.read_text()) if vf.exists() else 0) + 1
    time.sleep(float(os.environ.get("LOOM_TEST_TRAIN_SECONDS", "0.3")))
    vf.write_text(str(version))
    with STATE.open("a") as f:
        f.write(f"{b.step} {version} {len(b.groups)}\n")
    n_tokens = sum(len(t.completion_ids) for g in b.groups for t in g.trajectories)
    return StepResult(
        step=b.step, policy_version=version, metrics={"loss": 0.0}, n_tokens=n_tokens
    ).model_dump(mode="json")
