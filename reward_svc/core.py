"""Scoring a group: plan accuracy, verify math items (in the pool), compose components.

Pure: no HTTP, no Celery. The API awaits the pool, the Celery task blocks on it; both call
``plan_group`` then ``finish_group``, after the spec check (``loom.contracts.rewards.check_spec``).
``check_request`` enforces the request-level limit; ``oversized``, ``without`` and ``with_refused``
give an over-long item its own status instead of failing the batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loom.clients.judge import JudgeAsk, JudgeReply
from loom.contracts.rewards import AccuracyParams, CodeParams, JudgeParams, ProcessParams, RequestError
from loom.contracts.sandbox import RunRequest, RunResult
from loom.contracts.wire import Group, RewardResult, RewardSpec, TrajectoryReward
from reward_svc import process as prm
from reward_svc.accuracy import plan, read_gold
from reward_svc.code import CodeTests, CodeVerdict, judge, plan_runs, read_tests
from reward_svc.context import GroupContext
from reward_svc.judge import JudgeVerdict, plan_asks, verdict_of
from reward_svc.mathverify import MathItem, Verdict
from reward_svc.registry import NEEDS_ACCURACY, NEEDS_CODE, NEEDS_JUDGE, NEEDS_PROCESS, REGISTRY
from reward_svc.trace import view_of

VerifyFn = Callable[[Sequence[MathItem], int], list[Verdict]]
AsyncVerifyFn = Callable[[Sequence[MathItem], int], Awaitable[list[Verdict]]]
# the sandbox service's batch call (``loom.clients.sandbox.SandboxClient.run_batch``)
RunCodeFn = Callable[[Sequence[RunRequest]], list[RunResult]]
AsyncRunCodeFn = Callable[[Sequence[RunRequest]], Awaitable[list[RunResult]]]
AskJudgeFn = Callable[[Sequence[JudgeAsk]], list[JudgeReply]]
# the judge servers' batch call (``loom.clients.judge.JudgeClient.ask_batch``)
AsyncAskJudgeFn = Callable[[Sequence[JudgeAsk]], Awaitable[list[JudgeReply]]]


def check_request(groups: Sequence[Group], max_items: int) -> None:
    """The request-level limit: more trajectories than ``max_items`` is a 413 (a batch to split)."""
    n = sum(len(g.trajectories) for g in groups)
    if n > max_items:
        raise RequestError(
            413, ["body", "groups"], f"{n} trajectories exceed the limit of {max_items} per request"
        )


Refused = dict[int, str]  # trajectory index in its group -> why it is not scored


def oversized(group: Group, max_chars: int) -> Refused:
    """Trajectories not scored for their size: a text over ``max_chars``, or every one of the group
    when its prompt or label is. One long item never fails the batch (docs/interop-reward.md)."""
    for name in ("prompt", "label"):
        value = getattr(group, name)
        if value is not None and len(value) > max_chars:
            why = f"{name} longer than {max_chars} characters (LOOM_REWARD_MAX_CHARS)"
            return dict.fromkeys(range(len(group.trajectories)), why)
    return {
        i: f"text longer than {max_chars} characters (LOOM_REWARD_MAX_CHARS)"
        for i, t in enumerate(group.trajectories)
        if t.text is not None and len(t.text) > max_chars
    }


def without(group: Group, refused: Refused) -> Group:
    """The group less its refused trajectories (group-relative components see the rest)."""
    if not refused:
        return group
    kept = [t for i, t in enumerate(group.trajectories) if i not in refused]
    return group.model_copy(update={"trajectories": kept})


def with_refused(result: RewardResult, group: Group, refused: Refused, spec: RewardSpec) -> RewardResult:
    """``result`` (of ``without(group, refused)``) with each refused trajectory back in its place:
    total and every component 0, status ``invalid``, the reason in ``detail``."""
    if not refused:
        return result
    scored = iter(result.rewards)
    zero = {c.name: 0.0 for c in spec.components}
    rewards = [
        TrajectoryReward(
            trajectory_id=t.id, total=0.0, components=dict(zero), status="invalid", detail=refused[i]
        )
        if i in refused
        else next(scored)
        for i, t in enumerate(group.trajectories)
    ]
    return result.model_copy(update={"rewards": rewards})


@dataclass
class Plan:
    group: Group
    spec: RewardSpec
    verdicts: list[Verdict | None]
    math: list[tuple[int, MathItem]] = field(default_factory=list)
    needs_accuracy: bool = False
    # the code task: its tests, each trajectory's verdict (decided, or judged from its runs)
    tests: CodeTests | None = None
    code_verdicts: list[CodeVerdict | None] = field(default_factory=list)
    code: list[tuple[int, list[RunRequest]]] = field(default_factory=list)
    # the judge component: its mode, each trajectory's verdict (decided, or read from its reply)
    judge_mode: str = "verdict"
    judge_verdicts: list[JudgeVerdict | None] = field(default_factory=list)
    judge: list[tuple[int, JudgeAsk]] = field(default_factory=list)
    # the process component: its name and aggregate, each trajectory's verdict, its steps' requests
    process_name: str = "process"
    process_how: str = "min"
    process_verdicts: list[prm.ProcessVerdict | None] = field(default_factory=list)
    process: list[tuple[int, list[prm.Step], list[JudgeAsk]]] = field(default_factory=list)

    @property
    def asks(self) -> list[JudgeAsk]:
        """Every judge and PRM request of the plan, in order (one judge batch): the judge's, then each
        trajectory's steps'."""
        return [a for _, a in self.judge] + [a for _, _, asks in self.process for a in asks]

    @property
    def runs(self) -> list[RunRequest]:
        """Every run of the plan's code trajectories, in order (one sandbox batch)."""
        return [r for _, runs in self.code for r in runs]


def plan_group(group: Group, spec: RewardSpec, decode: prm.Decode | None = None) -> Plan:
    """What scoring ``group`` needs. ``decode``: the policy's token decoding the process component cuts
    steps with (None: the ``LOOM_MODEL`` tokenizer's, loaded when a trajectory has token ids)."""
    needs = any(c.name in NEEDS_ACCURACY for c in spec.components)
    p = Plan(group, spec, [None] * len(group.trajectories), needs_accuracy=needs)
    acc = next((c for c in spec.components if c.name == "accuracy"), None)
    params = AccuracyParams.model_validate(acc.params if acc else {})
    task = params.task or group.task or "math"
    if any(c.name in NEEDS_CODE for c in spec.components) or (needs and task == "code"):
        _plan_code(p, spec)
    if any(c.name in NEEDS_JUDGE for c in spec.components):
        _plan_judge(p, spec)
    if any(c.name in NEEDS_PROCESS for c in spec.components):
        _plan_process(p, spec, decode)
    if not needs or task == "code":
        return p
    gold = read_gold(task, group.label, group.meta)
    for i, traj in enumerate(group.trajectories):
        decided = plan(task, gold, traj.text, params)
        if isinstance(decided, MathItem):
            p.math.append((i, decided))
        else:
            p.verdicts[i] = decided
    return p


def _plan_code(p: Plan, spec: RewardSpec) -> None:
    comp = next((c for c in spec.components if c.name in NEEDS_CODE), None)
    params = CodeParams.model_validate(comp.params if comp else {})
    tests = read_tests(p.group.label)
    p.tests = tests if isinstance(tests, CodeTests) else None
    p.code_verdicts = [None] * len(p.group.trajectories)
    for i, traj in enumerate(p.group.trajectories):
        planned = plan_runs(tests, traj.text, params)
        if isinstance(planned, CodeVerdict):
            p.code_verdicts[i] = planned
        else:
            p.code.append((i, planned))


def _plan_judge(p: Plan, spec: RewardSpec) -> None:
    comp = next(c for c in spec.components if c.name in NEEDS_JUDGE)
    params = JudgeParams.model_validate(comp.params)
    p.judge_mode = params.mode
    p.judge_verdicts = [None] * len(p.group.trajectories)
    for i, planned in enumerate(plan_asks(p.group, params)):
        if isinstance(planned, JudgeVerdict):
            p.judge_verdicts[i] = planned
        else:
            p.judge.append((i, planned))


def _plan_process(p: Plan, spec: RewardSpec, decode: prm.Decode | None) -> None:
    comp = next(c for c in spec.components if c.name in NEEDS_PROCESS)
    params = ProcessParams.model_validate(comp.params)
    p.process_name, p.process_how = comp.name, params.aggregate
    if decode is None and any(t.completion_ids for t in p.group.trajectories):
        try:
            decode = prm.policy_decoder()
        except (OSError, ValueError, ImportError):  # no tokenizer here: steps in characters
            decode = None
    p.process_verdicts = [None] * len(p.group.trajectories)
    for i, planned in enumerate(prm.plan_asks(p.group, params, decode)):
        if isinstance(planned, prm.ProcessVerdict):
            p.process_verdicts[i] = planned
        else:
            p.process.append((i, planned, prm.asks_of(p.group, planned, params)))


def _read_replies(p: Plan, replies: Sequence[JudgeReply]) -> None:
    """The judge's replies (the first of the batch) and each trajectory's steps' into their verdicts."""
    if len(replies) != len(p.asks):
        raise ValueError(f"{len(replies)} judge replies for {len(p.asks)} requests")
    for (i, _), reply in zip(p.judge, replies, strict=False):
        p.judge_verdicts[i] = verdict_of(reply, p.judge_mode)
    k = len(p.judge)
    for i, steps, asks in p.process:
        p.process_verdicts[i] = prm.verdict_of(steps, replies[k : k + len(asks)], p.process_how)
        k += len(asks)


def _status(p: Plan, i: int, has_text: bool) -> tuple[str, str | None]:
    """A trajectory's status: its verdict's, else the judge's or the PRM's failure (not the policy's)."""
    verdict = p.verdicts[i]
    if verdict is not None:
        status, detail = verdict.status, verdict.detail
    else:
        status, detail = ("ok", None) if has_text else ("invalid", "trajectory has no text")
    for verdicts in (p.judge_verdicts, p.process_verdicts):
        judged = verdicts[i] if verdicts else None
        if status == "ok" and judged is not None and judged.status != "ok":
            status, detail = judged.status, judged.detail
    return status, detail


def _judge_code(p: Plan, results: Sequence[RunResult]) -> None:
    """Each code trajectory's verdict from its runs' outcomes; its status is the trajectory's."""
    k = 0
    for i, runs in p.code:
        assert p.tests is not None
        p.code_verdicts[i] = judge(p.tests, list(results[k : k + len(runs)]))
        k += len(runs)
    for i, decided in enumerate(p.code_verdicts):
        if decided is not None and p.verdicts[i] is None:
            p.verdicts[i] = Verdict(decided.status, correct=decided.all_passed, detail=decided.detail)


def finish_group(
    p: Plan,
    math_verdicts: Sequence[Verdict],
    state: Any = None,
    code_results: Sequence[RunResult] = (),
    judge_replies: Sequence[JudgeReply] = (),
) -> RewardResult:
    for (i, _), v in zip(p.math, math_verdicts, strict=True):
        p.verdicts[i] = v
    if p.code_verdicts:
        if len(code_results) != len(p.runs):
            raise ValueError(f"{len(code_results)} run outcomes for {len(p.runs)} runs")
        _judge_code(p, code_results)
    if p.judge_verdicts or p.process_verdicts:
        _read_replies(p, judge_replies)
    trajs = p.group.trajectories
    ctx = GroupContext(group=p.group, views=[view_of(t) for t in trajs], state=state)
    if p.code_verdicts:
        ctx.cache["code"] = p.code_verdicts
    if p.judge_verdicts:
        ctx.cache["judge"] = p.judge_verdicts
    if p.process_verdicts:
        ctx.cache["process"] = p.process_verdicts
    if p.needs_accuracy:
        ctx.correct = [float(v is not None and v.status == "ok" and v.correct) for v in p.verdicts]
    values = {c.name: REGISTRY[c.name](ctx, c.params) for c in p.spec.components}
    rewards = []
    for i, t in enumerate(trajs):
        comps = {name: _finite(vals[i]) for name, vals in values.items()}
        total = _finite(sum(c.weight * comps[c.name] for c in p.spec.components))
        status, detail = _status(p, i, t.text is not None)
        stepped = p.process_verdicts[i] if p.process_verdicts else None
        steps = {p.process_name: stepped.steps} if stepped is not None and stepped.status == "ok" else None
        rewards.append(
            TrajectoryReward(
                trajectory_id=t.id,
                total=total,
                components=comps,
                status=status,  # type: ignore[arg-type]
                detail=detail,
                steps=steps,
            )
        )
    return RewardResult(group_id=p.group.id, rewards=rewards)


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else 0.0


def _no_sandbox(runs: Sequence[RunRequest]) -> list[RunResult]:
    return [RunResult(status="sandbox_error", detail="no sandbox service configured") for _ in runs]


def no_judge(asks: Sequence[JudgeAsk]) -> list[JudgeReply]:
    return [JudgeReply("judge_unavailable", detail="no judge client in this caller") for _ in asks]


def score_group(
    group: Group,
    spec: RewardSpec,
    verify: VerifyFn,
    state: Any = None,
    run_code: RunCodeFn = _no_sandbox,
    ask_judge: AskJudgeFn = no_judge,
    decode: prm.Decode | None = None,
) -> RewardResult:
    """Plan, verify (blocking), run code, ask the judge, compose. ``verify`` is
    ``VerifierPool.check_many``, ``run_code`` the sandbox client's ``run_batch``."""
    t0 = time.perf_counter()
    p = plan_group(group, spec, decode)
    verdicts = verify([item for _, item in p.math], spec.timeout_s) if p.math else []
    result = finish_group(
        p, verdicts, state, run_code(p.runs) if p.runs else [], ask_judge(p.asks) if p.asks else []
    )
    result.score_s = time.perf_counter() - t0
    return result


async def _ano_sandbox(runs: Sequence[RunRequest]) -> list[RunResult]:
    return _no_sandbox(runs)


async def _ano_judge(asks: Sequence[JudgeAsk]) -> list[JudgeReply]:
    return no_judge(asks)


async def ascore_group(
    group: Group,
    spec: RewardSpec,
    verify: AsyncVerifyFn,
    state: Any = None,
    run_code: AsyncRunCodeFn = _ano_sandbox,
    ask_judge: AsyncAskJudgeFn = _ano_judge,
    decode: prm.Decode | None = None,
) -> RewardResult:
    """``score_group`` with the verifier, the sandbox and the judge awaited (``VerifierPool.acheck_many``,
    ``SandboxClient.arun_batch``, ``JudgeClient.ask_batch``): the groups of one reward task share them."""
    t0 = time.perf_counter()
    p = plan_group(group, spec, decode)
    verdicts = await verify([item for _, item in p.math], spec.timeout_s) if p.math else []
    runs = await run_code(p.runs) if p.runs else []
    result = finish_group(p, verdicts, state, runs, await ask_judge(p.asks) if p.asks else [])
    result.score_s = time.perf_counter() - t0
    return result
