"""What a job costs: its mode's worst case at admission, what it produced when it ends
(docs/security.md "Quotas", docs/operations.md "Cost and fair share").

A job is charged when it is accepted by the worst case its requests can generate, read from each
request's typed mode parameters (loom/contracts/modes.py), in trajectories (``samples``) and
generated completion tokens (``tokens``), per rollout request (one group):

- plain: n trajectories of at most ``max_tokens``;
- tree (TreeRL's EPTree): ``initial`` trees of 1 + ``iterations`` x ``branches`` x ``continuations``
  paths each, every path at most ``max_tokens`` (its copied prefix and its continuation);
- agent_tree: ``initial`` episode trees of 1 + ``iterations`` x ``branches`` x ``continuations``
  episodes each, every episode bounded as agent's (its copied prefix and its continuation);
- spawn (APR): n rollouts, each a parent and its children: ``max_children`` per spawn block down to
  ``max_depth`` levels (one block per call; a call that spawns again spends tokens, which the token
  bound covers), at most ``max_total_tokens`` over the rollout's calls;
- streaming: n trajectories, each ``rounds`` (one per sentence) of at most ``segment_cap`` thought
  tokens, then the deep phase and the answer (the revealed sentences are observations, not generated);
- with adaptive sampling every round a prompt may take (``max_rounds`` requests of
  ``samples_per_round``); with reflection one revision per trajectory of at most ``reflect.max_tokens``.

A run is charged by the same budget per prompt, for what its off-policy loop keeps in flight
(``run_budget``).

When the job ends (success, failure or cancel) its charge is settled to what it produced: the
trajectories of the groups it stored and their generated tokens (``produced``: the tokens a
trajectory trains on, its loss mask's ones, so observations and joined messages do not count). A
group is stored once per index (gateway/state.py), so a redelivered task or a resumed job is never
counted twice. Pure: no HTTP, no database.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gateway.quotas import Cost
from loom.contracts.jobs import TaskItem
from loom.contracts.modes import (
    AgentParams,
    AgentTreeParams,
    ModeLimits,
    ModeParams,
    SpawnParams,
    StreamingParams,
    TreeParams,
    mode_params_of,
)
from loom.contracts.wire import Group, Params, ReflectParams, RolloutRequest


def per_sample(params: ModeParams, max_tokens: int) -> tuple[int, int]:
    """(trajectories, generated tokens) one sample (``sampling.n`` = 1) of ``params``' mode may cost
    at most; tree's count is the whole group's (its ``initial`` does not follow n once resolved)."""
    if isinstance(params, TreeParams):
        paths = params.initial * (1 + params.iterations * params.branches * params.continuations)
        return paths, paths * max_tokens
    if isinstance(params, SpawnParams):
        children = sum(params.max_children**d for d in range(1, params.max_depth + 1))
        tokens = min(params.max_total_tokens, max_tokens + children * params.child_max_tokens)
        return 1 + children, tokens
    if isinstance(params, AgentTreeParams):  # agent's bound per episode, tree's count of episodes
        paths = params.initial * (1 + params.iterations * params.branches * params.continuations)
        return paths, paths * min(params.max_turns * max_tokens, params.max_total_tokens)
    if isinstance(params, AgentParams):  # every turn its full budget, within the episode's bound
        return 1, min(params.max_turns * max_tokens, params.max_total_tokens)
    if isinstance(params, StreamingParams):
        rounds = len(params.sentences)
        return 1, rounds * params.segment_cap + params.deep_max_tokens + params.answer_max_tokens
    return 1, max_tokens


def group_budget(request: RolloutRequest, limits: ModeLimits | None = None) -> Cost:
    """The worst case of one rollout request (one group) in trajectories and generated tokens."""
    params = mode_params_of(request, limits)
    samples, tokens = per_sample(params, request.sampling.max_tokens)
    if isinstance(params, TreeParams | AgentTreeParams):
        return Cost(samples, tokens)
    n = request.sampling.n
    return Cost(n * samples, n * tokens)


def job_budget(req: object, items: Sequence[TaskItem], limits: ModeLimits | None = None) -> Cost:
    """A job's charge: every item's ``prompt_budget``. ``req``: a ``JobRequest`` whose items carry
    their resolved mode parameters (gateway/validate.py)."""
    seen: dict[str, Cost] = {}
    samples = tokens = 0
    for item in items:
        mode_params = {**req.mode_params, **item.mode_params}  # type: ignore[attr-defined]
        key = repr(sorted(mode_params.items()))
        one = seen.get(key)
        if one is None:
            one = seen[key] = prompt_budget(req, mode_params, limits)
        samples += one.samples
        tokens += one.tokens
    return Cost(samples, tokens)


def prompt_budget(req: object, mode_params: Params, limits: ModeLimits | None = None) -> Cost:
    """One prompt's worst case under ``req`` (a job or a run) with ``mode_params`` (resolved): its
    group's budget at the sampling it is generated with, times the rounds adaptive sampling may
    take, plus reflection's revisions."""
    sampling = req.generated_sampling()  # type: ignore[attr-defined]
    adaptive = getattr(req, "adaptive", None)
    rounds = 1 if adaptive is None else int(adaptive.max_rounds)
    reflect = getattr(req, "reflect", None)
    if reflect is True:
        reflect = ReflectParams()
    revise_tokens = int(reflect.max_tokens) if reflect else 0
    request = RolloutRequest(
        mode=req.mode,  # type: ignore[attr-defined]
        prompt="",
        sampling=sampling,
        mode_params=mode_params,
        mode_params_resolved=True,
    )
    one = group_budget(request, limits)
    return Cost(
        rounds * one.samples * (2 if reflect else 1), rounds * (one.tokens + one.samples * revise_tokens)
    )


def run_budget(req: object, resolved: Sequence[Params], limits: ModeLimits | None = None) -> tuple[Cost, int]:
    """(a run's charge in flight, its samples over all its steps), from the costliest of its checked
    prompts' mode parameters (``resolved``; none: the run's own): a step's largest batch of such
    prompts, times the steps the off-policy loop keeps in flight (``staleness`` + 1); over the run,
    every step's batches (``filter_max_batches`` of them at most)."""
    forms = resolved or [req.mode_params]  # type: ignore[attr-defined]
    worst = max((prompt_budget(req, form, limits) for form in forms), key=lambda c: (c.tokens, c.samples))
    sched = req.schedule  # type: ignore[attr-defined]
    largest = max(sched.batch_size, sched.max_batch) if sched.adaptive_batch else sched.batch_size
    in_flight = (sched.staleness + 1) * largest
    total = sched.steps * largest * worst.samples * req.filter_max_batches  # type: ignore[attr-defined]
    return Cost(in_flight * worst.samples, in_flight * worst.tokens), total


def produced(groups: Iterable[Group]) -> Cost:
    """What ``groups`` hold: their trajectories, and the tokens each trains on (its loss mask's ones;
    every completion token when it has no mask)."""
    samples = tokens = 0
    for group in groups:
        for t in group.trajectories:
            samples += 1
            tokens += sum(t.loss_mask) if t.loss_mask is not None else len(t.completion_ids)
    return Cost(samples, tokens)
