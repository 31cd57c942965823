"""Trainer wire protocols translated to and from Loom's groups (shared/notes/protocols.md).

- OpenRLHF remote reward: ``{"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``;
- slime remote reward: ``{"prompt", "response", "label"}`` -> JSON with a ``reward`` field.
Unknown fields are ignored here (peers add fields over time); Loom's own extras are optional.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loom.schemas import Group, RewardResult, RewardSpec, TaskKind, Trajectory


class _Peer(BaseModel):
    model_config = ConfigDict(extra="ignore")


class OpenRLHFRequest(_Peer):
    query: list[str] = Field(min_length=1)
    prompts: list[str] | None = None
    labels: list[str | None] | None = None
    spec: RewardSpec | None = None
    task: TaskKind | None = None

    @model_validator(mode="after")
    def _aligned(self) -> OpenRLHFRequest:
        n = len(self.query)
        for name in ("prompts", "labels"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"{name} has {len(value)} entries for {n} queries")
        return self


class OpenRLHFResponse(BaseModel):
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]]


class SlimeRequest(_Peer):
    prompt: str = ""
    response: str
    label: str | None = None
    spec: RewardSpec | None = None
    task: TaskKind | None = None


def response_part(query: str, prompt: str) -> str:
    """The response inside OpenRLHF's ``query`` (prompt + response, special tokens kept)."""
    if not prompt:
        return query
    if query.startswith(prompt):
        return query[len(prompt) :]
    at = query.rfind(prompt)
    return query[at + len(prompt) :] if at >= 0 else query


def openrlhf_groups(req: OpenRLHFRequest) -> tuple[list[Group], list[tuple[int, int]]]:
    """One group per distinct (prompt, label), so group-relative components see the prompt's samples.
    Returns the groups and, per query, its (group index, trajectory index)."""
    prompts = req.prompts or [""] * len(req.query)
    labels = req.labels or [None] * len(req.query)
    keys: dict[tuple[str, str | None], int] = {}
    groups: list[Group] = []
    where: list[tuple[int, int]] = []
    for i, (q, p, lab) in enumerate(zip(req.query, prompts, labels, strict=True)):
        gi = keys.setdefault((p, lab), len(groups))
        if gi == len(groups):
            groups.append(Group(id=f"openrlhf-{gi}", prompt=p, label=lab, task=req.task))
        g = groups[gi]
        g.trajectories.append(Trajectory(id=f"q{i}", group_id=g.id, text=response_part(q, p)))
        where.append((gi, len(g.trajectories) - 1))
    return groups, where


def openrlhf_response(results: list[RewardResult], where: list[tuple[int, int]]) -> OpenRLHFResponse:
    rewards, scores = [], []
    logs: dict[str, list[float]] = {"status_ok": []}
    for gi, ti in where:
        r = results[gi].rewards[ti]
        rewards.append(r.total)
        # scores (0..1) drive OpenRLHF's dynamic filtering: accuracy when scored, else the clipped total
        scores.append(r.components.get("accuracy", min(1.0, max(0.0, r.total))))
        logs["status_ok"].append(float(r.status == "ok"))
        for name, value in r.components.items():
            logs.setdefault(name, []).append(value)
    return OpenRLHFResponse(rewards=rewards, scores=scores, extra_logs=logs)


def slime_group(req: SlimeRequest) -> Group:
    return Group(
        id="slime",
        prompt=req.prompt,
        label=req.label,
        task=req.task,
        trajectories=[Trajectory(id="response", group_id="slime", text=req.response)],
    )


def slime_response(result: RewardResult) -> dict[str, Any]:
    r = result.rewards[0]
    return {
        "reward": r.total,
        "score": r.total,
        "status": r.status,
        "components": r.components,
        **{k: v for k, v in r.components.items() if k not in ("reward", "score", "status", "components")},
    }
