"""Rollouts for external trainers: every rollout mode of Loom through the gateway's jobs, token-exact.

    from loom.clients.rollouts import Rollouts
    with Rollouts("http://gateway:8400", api_key="loom_...") as rollouts:
        for g in rollouts.stream(tasks, mode="tree", mode_params={"branches": 1}, sampling={"n": 4}):
            for s in g.samples:  # s.prompt_ids, s.completion_ids, s.logprobs, s.loss_mask, s.env_mask ...

One call is one gateway job (``POST /v1/jobs``: the key's auth and quotas, adaptive sampling,
reflection revisions and rewards come along); its groups come back as they finish, in the order
they finish (``GET /v1/jobs/{id}/events``, resumed with ``Last-Event-ID`` when the connection
drops). ``generate`` waits for all and returns them in prompt order. ``AsyncRollouts`` is the same
over asyncio.

What a sample carries (``RolloutSample``; every per-token list is aligned to ``completion_ids``):

- ``logprobs``: the behaviour log-prob of each token (0.0 on tokens the mode inserted);
- ``loss_mask``: the tokens Loom's learner trains (the trajectory's ``loss_mask`` and not inside an
  ``observation`` segment);
- ``env_mask``: 1 where the policy sampled the token, 0 where the mode inserted it (streaming's
  context sentences and forced markers, spawn's join blocks, a reflection revision's forced ending);
- ``advantages``: the per-token advantages the mode defines: tree mode's TreeRL node advantages
  (AttnRL eq. 2-3 on the leaves' correctness, as ``learner.estimators.treerl`` assigns them; with
  ``treerl={"process_weight": w}`` on the client, each node's value mixes in its PRM step score as
  the learner's estimator does, docs/algorithms.md §5.4); None for the other modes, whose
  advantages are the estimator's choice (group-normalised rewards);
- ``policy_version`` (and ``policy_namespace``), the reward the job's spec gave (``reward``,
  ``components``, ``reward_status``) and the ``Trajectory`` itself (``segments``, ``parent_id``, meta).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loom.clients.base import Closing, EventLines, LoomHTTPError, response_body
from loom.clients.gateway import GatewayClient
from loom.contracts.estimators import TREERL_REWARD_KEY, TreerlParams
from loom.contracts.jobs import ScoredGroup
from loom.contracts.modes import ModeLimits, ModeParams, _Context, parse_mode_params
from loom.contracts.policies import PolicyMatch
from loom.contracts.wire import (
    Group,
    Mode,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    SamplingParams,
    Segment,
    Trajectory,
    TrajectoryReward,
    TreeNode,
)
from loom.treerl import node_process_scores, token_advantages, tree_values

_RETRY_STATUS = (502, 503, 504)


@dataclass
class RolloutSample:
    """One trajectory as a trainer consumes it (module docstring)."""

    trajectory: Trajectory
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float] | None
    loss_mask: list[int]
    env_mask: list[int]
    policy_version: int
    policy_namespace: str | None
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    reward_status: str | None = None
    advantages: list[float] | None = None

    @property
    def id(self) -> str:
        return self.trajectory.id

    @property
    def segments(self) -> list[Segment]:
        return self.trajectory.segments

    @property
    def text(self) -> str | None:
        return self.trajectory.text


@dataclass
class RolloutGroup:
    """One prompt's group: ``index`` is the prompt's position in the call; ``group`` None when adaptive
    sampling dropped the prompt (``samples`` is then empty). ``node_values``: tree mode's V(s) per
    node (AttnRL eq. 2)."""

    index: int
    group: Group | None
    rewards: RewardResult | None
    samples: list[RolloutSample]
    node_values: dict[str, float] | None = None

    @classmethod
    def from_event(
        cls,
        payload: ScoredGroup | Mapping[str, Any],
        treerl: TreerlParams | Mapping[str, Any] | None = None,
    ) -> RolloutGroup:
        """A ``ScoredGroup`` (loom/contracts/jobs.py) as the gateway stores and streams it, parsed
        with the gateway's own model; a tree's advantages under ``treerl`` (the learner's estimator
        parameters: its reward key, its process weight)."""
        scored = payload if isinstance(payload, ScoredGroup) else ScoredGroup.model_validate(payload)
        group, rewards = scored.group, scored.rewards
        if group is None:
            return cls(scored.index, None, rewards, [])
        by_id = {r.trajectory_id: r for r in rewards.rewards} if rewards is not None else {}
        advantages, values = (
            tree_advantages(group, by_id, params=_treerl(treerl)) if group.tree else ({}, None)
        )
        samples = [_sample(t, by_id.get(t.id), advantages.get(t.id)) for t in group.trajectories]
        return cls(scored.index, group, rewards, samples, values)


def _sample(t: Trajectory, r: TrajectoryReward | None, advantages: list[float] | None) -> RolloutSample:
    return RolloutSample(
        trajectory=t,
        prompt_ids=list(t.prompt_ids),
        completion_ids=list(t.completion_ids),
        logprobs=None if t.logprobs is None else list(t.logprobs),
        loss_mask=trained_mask(t),
        env_mask=env_mask(t),
        policy_version=t.policy_version,
        policy_namespace=t.policy_namespace,
        reward=None if r is None else r.total,
        components={} if r is None else dict(r.components),
        reward_status=None if r is None else r.status,
        advantages=advantages,
    )


# ------------------------------------------------------------------------------------------------
# token masks and tree advantages: pure, on the wire contracts


def _observations(t: Trajectory) -> list[int]:
    inside = [0] * len(t.completion_ids)
    for seg in t.segments:
        if seg.kind == "observation":
            inside[seg.start : seg.end] = [1] * (seg.end - seg.start)
    return inside


def trained_mask(t: Trajectory) -> list[int]:
    """The tokens the learner trains: ``loss_mask`` (default all) and not inside an observation."""
    mask = list(t.loss_mask) if t.loss_mask is not None else [1] * len(t.completion_ids)
    return [m * (1 - o) for m, o in zip(mask, _observations(t), strict=True)]


def env_mask(t: Trajectory) -> list[int]:
    """1 where the policy sampled the token, 0 where the mode inserted it: observation segments,
    a revision's forced ending (its segment's ``[start, meta.forced_end)``) and, outside tree mode,
    every other loss-masked token (streaming's forced markers, spawn's join blocks). A tree branch's
    loss-masked prefix (``train_prefix=False``) was sampled by the policy, on its parent path: 1."""
    n = len(t.completion_ids)
    mask = [1 - o for o in _observations(t)]
    for s in t.segments:
        if s.kind == "revision" and "forced_end" in s.meta:
            a, b = s.start, int(s.meta["forced_end"])
            mask[a:b] = [0] * (b - a)
    in_tree = any(s.kind == "tree_node" for s in t.segments)
    if t.loss_mask is not None and not in_tree:
        mask = [m * lm for m, lm in zip(mask, t.loss_mask, strict=True)]
    return mask[:n]


def tree_advantages(
    group: Group,
    rewards: Mapping[str, TrajectoryReward],
    reward_key: str | None = None,
    params: TreerlParams | None = None,
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """TreeRL's per-token advantages of a tree group and its node values (AttnRL eq. 2-3):

        V(s) = mean correctness of the leaves under s                          (eq. 2)
        A(s) = (V(s) - V(root) + V(s) - V(parent(s))) / sqrt(|L(s)|)            (eq. 3)

    A leaf's correctness is its ``reward_key`` component (default accuracy; the total when absent).
    Each trained token gets the advantage of the deepest node on its trajectory's path that covers
    it (a node of another trajectory counts where this completion repeats its tokens, the copied
    prefix of a branch); the rest of the trained tokens get the leaf's; untrained tokens get 0.
    The same assignment as the learner's ``treerl`` estimator: both call ``loom/treerl.py``. With
    ``params.process_weight`` w > 0 a node's value is (1 - w) V(s) + w P(s), P its segment's step score
    under ``params.process_key`` (docs/algorithms.md §5.4); a scored trajectory without step scores,
    or a group with none, is a ValueError, as the learner refuses such a batch."""
    p = params or TreerlParams()
    reward_key = reward_key or p.reward_key or TREERL_REWARD_KEY
    tree: list[TreeNode] = list(group.tree or [])
    by_traj = {t.id: t for t in group.trajectories}
    leaf_value: dict[str, float] = {}
    for t in group.trajectories:
        r = rewards.get(t.id)
        leaf_value[t.id] = 0.0 if r is None else float(r.components.get(reward_key, r.total))
    process = _process_scores(group, rewards, p) if p.process_weight > 0 else None
    try:
        values = tree_values(tree, leaf_value, process, p.process_weight)
    except ValueError as e:
        raise ValueError(f"group {group.id}: the tree is not a tree: {e}") from None
    out = {t.id: token_advantages(tree, values, t, by_traj, trained_mask(t)) for t in group.trajectories}
    return out, values.value


def _process_scores(
    group: Group, rewards: Mapping[str, TrajectoryReward], p: TreerlParams
) -> dict[str, float]:
    """Each node's PRM score (``loom.treerl.node_process_scores``) from the trajectories' step scores
    under ``p.process_key``, checked as the learner checks them (``learner.estimators.common``)."""
    steps: dict[str, list[tuple[int, int, float]]] = {}
    for t in group.trajectories:
        r = rewards.get(t.id)
        scored = None if r is None else (r.steps or {}).get(p.process_key)
        if scored is None:
            if r is not None and r.status == "ok":
                raise ValueError(
                    f"trajectory {t.id} of group {group.id} has no step scores of component "
                    f"{p.process_key!r}: score the job with the process reward (docs/interop-reward.md)"
                )
            continue
        for s in scored:
            if s.unit != "token" or not s.start < s.end <= len(t.completion_ids):
                raise ValueError(f"trajectory {t.id}: step [{s.start}, {s.end}) is not a token span of it")
        steps[t.id] = [(s.start, s.end, s.score) for s in scored]
    if not steps:
        raise ValueError(f"group {group.id} has no step scores of component {p.process_key!r}")
    return node_process_scores(group.tree or [], steps)


# ------------------------------------------------------------------------------------------------
# the job request


def job_body(
    prompts: Sequence[str | Mapping[str, Any]],
    *,
    mode: Mode = "plain",
    mode_params: ModeParams | Mapping[str, Any] | None = None,
    sampling: SamplingParams | Mapping[str, Any] | None = None,
    reward: RewardSpec | Mapping[str, Any] | None = None,
    adaptive: Mapping[str, Any] | None = None,
    reflect: bool = False,
    policy_version: int | None = None,
    policy_namespace: str | None = None,
    policy_match: PolicyMatch | None = None,
    job_key: str | None = None,
) -> dict[str, Any]:
    """The ``JobRequest`` body (gateway/models.py) of one call. ``prompts``: texts, or task dicts
    ``{"prompt", "label", "task", "mode_params"}`` (per-item mode parameters, e.g. streaming's
    sentences, merged over ``mode_params``). The mode parameters are parsed once, by the gateway at
    submission: a bad one is a 422 naming it (``LoomHTTPError``) before any job exists
    (docs/architecture.md, "Contracts"). The policy fields are sent only when given."""
    samp = sampling if isinstance(sampling, SamplingParams) else SamplingParams.model_validate(sampling or {})
    common = _params_dict(mode_params)
    tasks: list[dict[str, Any]] = []
    for p in prompts:
        item: dict[str, Any] = {"prompt": p} if isinstance(p, str) else dict(p)
        item["mode_params"] = {**common, **dict(item.get("mode_params") or {})}
        tasks.append({k: v for k, v in item.items() if v is not None and v != {}})
    body: dict[str, Any] = {
        "job_key": job_key or f"rollouts-{uuid.uuid4().hex}",
        "tasks": tasks,
        "mode": mode,
        "sampling": samp.model_dump(mode="json", exclude_defaults=True),
        "reflect": reflect,
    }
    if reward is not None:
        body["reward"] = reward.model_dump(mode="json") if isinstance(reward, RewardSpec) else dict(reward)
    if adaptive is not None:
        body["adaptive"] = dict(adaptive)
    for name, value in (
        ("policy_version", policy_version),
        ("policy_namespace", policy_namespace),
        ("policy_match", policy_match),
    ):
        if value is not None:
            body[name] = value
    return body


def check_mode_params(
    mode: Mode, params: ModeParams | Mapping[str, Any] | None, item: Mapping[str, Any]
) -> None:
    """A trainer adapter's configuration checked once, when it is built (``ModeError`` naming the
    parameter), so a bad setting fails before the first rollout; ``item``: the per-item parameters
    a real prompt would bring (streaming's sentences). Each request's own parse is the gateway's."""
    merged = {**_params_dict(params), **item}
    parse_mode_params(RolloutRequest(mode=mode, prompt="x", mode_params=merged))


def _params_dict(params: ModeParams | Mapping[str, Any] | None) -> dict[str, Any]:
    """A typed ``ModeParams`` as the keys that differ from what its model fills in by itself (the field
    defaults, and the defaults that follow the request or the deployment, which a model built
    without a request takes from the default sampling and limits): those the gateway fills in for
    this request and this deployment."""
    if params is None:
        return {}
    if not isinstance(params, ModeParams):
        return dict(params)
    implied = type(params).request_defaults(_Context(ModeLimits(), SamplingParams()))
    return {
        k: v
        for k, v in params.model_dump(mode="json", exclude_defaults=True).items()
        if k not in implied or implied[k] != v
    }


# ------------------------------------------------------------------------------------------------
# the clients


def _treerl(params: TreerlParams | Mapping[str, Any] | None) -> TreerlParams | None:
    return (
        params if params is None or isinstance(params, TreerlParams) else TreerlParams.model_validate(params)
    )


class _RolloutsBase:
    """What the two clients take alike: a gateway (``api_key`` with the ``jobs`` scope), the tries an
    event stream gets after a dropped connection (``reconnects``), and ``treerl``, the trainer's
    TreeRL parameters (``TreerlParams``: reward key, process weight) for tree groups' advantages."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        reconnects: int = 5,
        treerl: TreerlParams | Mapping[str, Any] | None = None,
    ) -> None:
        self._connect(url, api_key, timeout)
        self.treerl = _treerl(treerl)
        self.reconnects = reconnects
        self.reconnections = 0  # event streams resumed after a dropped connection

    def _connect(self, url: str, api_key: str | None, timeout: float) -> None:
        raise NotImplementedError


class Rollouts(_RolloutsBase, Closing):
    """Synchronous rollouts through a gateway (``_RolloutsBase``'s arguments)."""

    def _connect(self, url: str, api_key: str | None, timeout: float) -> None:
        self.gateway = GatewayClient(url, api_key=api_key, timeout=timeout)

    def submit(self, prompts: Sequence[str | Mapping[str, Any]], **kwargs: Any) -> str:
        """Start one job (``job_body``'s arguments); its id."""
        return self.gateway.submit_job(job_body(prompts, **kwargs))

    def groups(self, job_id: str) -> Iterator[RolloutGroup]:
        """The job's groups as they finish; raises ``RolloutJobError`` when the job fails."""
        resume = _Resume(job_id, self.reconnects, self.treerl)
        while True:
            try:
                for event in self.gateway.job_events_with_ids(job_id, resume.last):
                    if (group := resume.group(*event)) is None:
                        return
                    yield group
                return
            except (httpx.TransportError, LoomHTTPError) as exc:
                time.sleep(resume.delay(exc))
                self.reconnections += 1

    def stream(self, prompts: Sequence[str | Mapping[str, Any]], **kwargs: Any) -> Iterator[RolloutGroup]:
        """Submit and yield each group as it finishes (in finishing order)."""
        yield from self.groups(self.submit(prompts, **kwargs))

    def generate(self, prompts: Sequence[str | Mapping[str, Any]], **kwargs: Any) -> list[RolloutGroup]:
        """Submit and wait: every group, in prompt order."""
        return sorted(self.stream(prompts, **kwargs), key=lambda g: g.index)

    def cancel(self, job_id: str) -> None:
        self.gateway.cancel_job(job_id)

    def close(self) -> None:
        self.gateway.close()


class RolloutJobError(RuntimeError):
    """The job ended without every group (failed or cancelled); ``status`` and the gateway's ``error``."""

    def __init__(self, job_id: str, status: str, error: str | None) -> None:
        self.job_id, self.status, self.error = job_id, status, error
        super().__init__(f"job {job_id} {status}: {error}")


@dataclass
class _Resume:
    """A job's event stream across dropped connections: the id of the last group it gave (to go on
    after) and the tries since then."""

    job_id: str
    reconnects: int
    treerl: TreerlParams | None = None
    last: int | None = None
    tries: int = 0

    def group(self, kind: str, event_id: int | None, data: Any) -> RolloutGroup | None:
        """The group an event carries; None at the job's end (``RolloutJobError`` when it failed)."""
        if kind == "end":
            _check_end(self.job_id, data)
            return None
        self.last, self.tries = event_id, 0
        return RolloutGroup.from_event(data, self.treerl)

    def delay(self, exc: httpx.TransportError | LoomHTTPError) -> float:
        """The wait before the next try; ``exc`` again when it is not worth one (an HTTP error other
        than 502/503/504) or the tries are spent."""
        self.tries += 1
        if (
            isinstance(exc, LoomHTTPError) and exc.status not in _RETRY_STATUS
        ) or self.tries > self.reconnects:
            raise exc
        return min(0.2 * 2**self.tries, 5.0)


def _check_end(job_id: str, data: Mapping[str, Any]) -> None:
    if data.get("status") != "succeeded":
        raise RolloutJobError(job_id, str(data.get("status")), data.get("error"))


class AsyncRollouts(_RolloutsBase):
    """``Rollouts`` over asyncio (httpx.AsyncClient): ``await submit``, ``async for g in stream``."""

    def _connect(self, url: str, api_key: str | None, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=timeout)

    async def submit(self, prompts: Sequence[str | Mapping[str, Any]], **kwargs: Any) -> str:
        body = job_body(prompts, **kwargs)
        for attempt in range(self.reconnects + 1):
            try:
                r = await self.http.post("/v1/jobs", json=body)
            except httpx.TransportError:
                if attempt == self.reconnects:
                    raise
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
                continue
            if r.status_code in _RETRY_STATUS and attempt < self.reconnects:
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0))
                continue
            if r.status_code >= 400:
                raise LoomHTTPError(r.status_code, response_body(r))
            return str(r.json()["id"])
        raise AssertionError("unreachable")

    async def groups(self, job_id: str) -> AsyncIterator[RolloutGroup]:
        resume = _Resume(job_id, self.reconnects, self.treerl)
        while True:
            headers = {} if resume.last is None else {"Last-Event-ID": str(resume.last)}
            try:
                async with self.http.stream(
                    "GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=None
                ) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise LoomHTTPError(r.status_code, response_body(r))
                    events = EventLines()
                    async for line in r.aiter_lines():
                        if (event := events.feed(line)) is None:
                            continue
                        if (group := resume.group(*event)) is None:
                            return
                        yield group
                return
            except (httpx.TransportError, LoomHTTPError) as exc:
                await asyncio.sleep(resume.delay(exc))
                self.reconnections += 1

    async def stream(
        self, prompts: Sequence[str | Mapping[str, Any]], **kwargs: Any
    ) -> AsyncIterator[RolloutGroup]:
        job_id = await self.submit(prompts, **kwargs)
        async for g in self.groups(job_id):
            yield g

    async def generate(self, prompts: Sequence[str | Mapping[str, Any]], **kwargs: Any) -> list[RolloutGroup]:
        return sorted([g async for g in self.stream(prompts, **kwargs)], key=lambda g: g.index)

    async def cancel(self, job_id: str) -> None:
        r = await self.http.post(f"/v1/jobs/{job_id}/cancel")
        if r.status_code >= 400:
            raise LoomHTTPError(r.status_code, response_body(r))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncRollouts:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
