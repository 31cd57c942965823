"""Trainer wire protocols translated to and from Loom's groups (docs/interop-reward.md).

- OpenRLHF remote reward (``openrlhf/utils/agent.py``, ``SingleTurnAgentExecutor``):
  ``{"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``;
- slime remote reward (``slime/rollout/rm_hub/__init__.py``, ``remote_rm``): ``{"prompt", "response",
  "label"}`` -> the reply's JSON is the reward itself, so the default route answers a bare number and
  ``/components`` the dict (for ``--reward-key reward``).

An item's content never fails the request: a label of any JSON type is coerced (``loom.interop``), and
one that cannot be read, or a text over the size limit, is that item's ``invalid`` status with reward 0.
Only a wrong JSON shape is a 422. Unknown fields are ignored (peers add fields over time); Loom's own
extras (``spec``, ``task``) are optional.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loom.contracts.wire import EncodableText, Group, RewardResult, RewardSpec, TaskKind, Trajectory
from loom.interop import LabelError, label_text, message_text
from reward_svc.core import Refused

# a chat prompt: slime's ``Sample.prompt: str | list[dict]``
Prompt = str | list[dict[str, Any]]


class _Peer(EncodableText):
    model_config = ConfigDict(extra="ignore")


class OpenRLHFRequest(_Peer):
    query: list[str] = Field(min_length=1)
    prompts: list[Prompt] | None = None
    labels: list[Any] | None = Field(default=None, description="any JSON value per query (label_text)")
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
    prompt: Prompt = ""
    response: str
    label: Any = Field(default=None, description="any JSON value (label_text)")
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


def _label(value: Any) -> tuple[str | None, str | None]:
    """(label text, why the item is refused)."""
    try:
        return label_text(value), None
    except LabelError as exc:
        return None, f"label: {exc}"


def openrlhf_groups(req: OpenRLHFRequest) -> tuple[list[Group], list[tuple[int, int]], list[Refused]]:
    """One group per distinct (prompt, label), so group-relative components see the prompt's samples.
    Returns the groups, per query its (group index, trajectory index), and per group the trajectories
    refused for an unreadable label."""
    prompts = [message_text(p) for p in req.prompts] if req.prompts else [""] * len(req.query)
    labels = req.labels or [None] * len(req.query)
    keys: dict[tuple[str, str | None], int] = {}
    groups: list[Group] = []
    refused: list[Refused] = []
    where: list[tuple[int, int]] = []
    for i, (q, p, raw) in enumerate(zip(req.query, prompts, labels, strict=True)):
        lab, why = _label(raw)
        gi = keys.setdefault((p, lab), len(groups))
        if gi == len(groups):
            groups.append(Group(id=f"openrlhf-{gi}", prompt=p, label=lab, task=req.task))
            refused.append({})
        g = groups[gi]
        if why:
            refused[gi][len(g.trajectories)] = why
        g.trajectories.append(Trajectory(id=f"q{i}", group_id=g.id, text=response_part(q, p)))
        where.append((gi, len(g.trajectories) - 1))
    return groups, where, refused


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


def slime_group(req: SlimeRequest) -> tuple[Group, Refused]:
    lab, why = _label(req.label)
    group = Group(
        id="slime",
        prompt=message_text(req.prompt),
        label=lab,
        task=req.task,
        trajectories=[Trajectory(id="response", group_id="slime", text=req.response)],
    )
    return group, ({0: why} if why else {})


def slime_components(result: RewardResult) -> dict[str, Any]:
    """The dict reply: ``reward``, ``status`` (``--log-reward-category status`` logs its shares),
    ``detail`` and every component, also flat (a component is a valid ``--reward-key``); a process
    reward's step scores under ``steps`` (component -> its steps' start, end, score, unit)."""
    r = result.rewards[0]
    steps = {k: [s.model_dump(mode="json") for s in v] for k, v in (r.steps or {}).items()}
    return {
        **({"steps": steps} if steps else {}),
        **r.components,
        "reward": r.total,
        "score": r.total,
        "status": r.status,
        "detail": r.detail,
        "components": r.components,
    }
