"""tree (ALGORITHMS.md 2.3; TreeRL, AttnRL §3.1-3.2 and appendix E): branch sampled responses.

1. Initial sampling: M' responses (``initial``, default 6; ``sampling.n`` when ``initial`` is unset
   and n > 1).
2. Steps: a response is split after every token whose text completes a ``"\\n\\n"``; it falls back
   to ``"\\n"`` when the blank lines leave fewer than 3 steps up to ``</think>`` (no step between the
   first, which never branches, and the one that ends the thinking: one paragraph of reasoning).
3. Difficulty-aware expansion (AttnRL eq. 9): with a reward callback, z = the initial accuracy and
   M = round(exp(-z) M') trees are expanded (``expansion="ceil"``: the authors' ceil(exp(-i/n) n));
   attention-based filtering (eq. 8): an all-correct prompt is expanded only if its mean FCI >=
   ``fci_running_mean`` (the caller keeps the running mean; the group returns ``meta["mean_fci"]``).
   Without a callback all M' trees are expanded.
4. Branch points of each expanded response (pluggable ``strategy``):
   - ``attention``: FCI of every step (loom.fci, eq. 5-6, delta = 4); the prompt step, the first
     response step and steps from ``</think>`` on score 0; candidates are the eligible steps with
     FCI >= the 0.8-quantile of eligible scores (eq. 7, quantile over non-zeroed steps, > 0 only);
     the N earliest (default 2) at least ``min_distance`` tokens apart (default 512);
   - ``entropy`` (TreeRL): the N tokens with the highest -log-prob of the sampled token, masking the
     first token of the response and everything from the first token containing "answer" or
     "conclusion"; same ``min_distance`` rule;
   - ``random``: N random step starts (never the first step), same ``min_distance`` rule.
5. Branch: prompt + response[:branch start] -> T continuations (default 2), one engine call with n=T,
   so a prefix-caching engine computes only the new tokens.

Reward callback (``reward_fn``): ``(trajectories) -> correctness in [0, 1] per trajectory`` (sync or
async). The mode stays pure; ``exact_reward_fn`` builds one from loom.exact for arithmetic/countdown
requests with a label. Attention scores come from the engine (``attention_scores`` capability: the
torch engine, ``loom engine``) or, when ``mode_params.attention_url`` is set, from a learner / loom
engine's ``POST /v1/score/attention``; otherwise attention branching is ``UnsupportedCapability``.

The group records the tree: trajectory i is the initial response i or a branch (its completion is the
copied prefix + the continuation, ``parent_id`` = the response it branched from); ``Group.tree`` holds
nodes with parents and completion-token spans; every trajectory has a ``tree_node`` segment per node
on its path. learner.advantages.treerl computes node advantages from exactly this.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import json
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loom.schemas import Group, RolloutRequest, Segment, Trajectory, TreeNode
from rollout_svc.engines.base import Completion, Engine, UnsupportedCapability
from rollout_svc.modes import ModeError, param, sample_seed, trajectory_id

Strategy = Literal["attention", "entropy", "random"]
RewardFn = Callable[[list[Trajectory]], "Sequence[float] | Awaitable[Sequence[float]]"]
Scorer = Callable[[list[int], list[tuple[int, int]], int, "int | None"], Awaitable[list[float]]]


@dataclass
class TreeConfig:
    initial: int = 6  # M'
    branches: int = 2  # N
    continuations: int = 2  # T
    strategy: Strategy = "attention"
    delta: int = 4
    quantile: float = 0.8
    min_distance: int = 512
    separator: str = "\n\n"
    fallback_separator: str = "\n"
    end_marker: str = "</think>"
    entropy_stop_words: tuple[str, ...] = ("answer", "conclusion")
    expansion: Literal["round", "ceil", "all"] = "round"
    fci_running_mean: float | None = None
    attention_url: str | None = None
    train_prefix: bool = True  # a branch's copied prefix is trained (TreeRL trains every leaf path)
    attention_timeout_s: float = 120.0
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_request(cls, request: RolloutRequest) -> TreeConfig:
        mp = dict(request.mode_params)
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        unknown = sorted(set(mp) - known)
        if unknown:
            raise ModeError(f"tree does not know mode_params {unknown}; known: {sorted(known)}")
        n = request.sampling.n
        cfg = cls(
            initial=param(mp, "initial", int, n if n > 1 else 6),
            branches=param(mp, "branches", int, 2),
            continuations=param(mp, "continuations", int, 2),
            strategy=param(mp, "strategy", str, "attention"),
            delta=param(mp, "delta", int, 4),
            quantile=param(mp, "quantile", float, 0.8),
            min_distance=param(mp, "min_distance", int, 512),
            separator=param(mp, "separator", str, "\n\n"),
            fallback_separator=param(mp, "fallback_separator", str, "\n"),
            end_marker=param(mp, "end_marker", str, "</think>"),
            expansion=param(mp, "expansion", str, "round"),
            fci_running_mean=param(mp, "fci_running_mean", float, None),
            attention_url=param(mp, "attention_url", str, None),
            train_prefix=param(mp, "train_prefix", bool, True),
            attention_timeout_s=param(mp, "attention_timeout_s", float, 120.0),
        )
        if "entropy_stop_words" in mp:
            words = mp["entropy_stop_words"]
            if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                raise ModeError("mode_params.entropy_stop_words must be a list of strings")
            cfg.entropy_stop_words = tuple(words)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.strategy not in ("attention", "entropy", "random"):
            raise ModeError(
                f"mode_params.strategy must be attention, entropy or random, got {self.strategy!r}"
            )
        if self.expansion not in ("round", "ceil", "all"):
            raise ModeError(f"mode_params.expansion must be round, ceil or all, got {self.expansion!r}")
        if not 1 <= self.initial <= 256 or not 0 <= self.branches <= 64 or not 1 <= self.continuations <= 64:
            raise ModeError("tree limits: 1 <= initial <= 256, 0 <= branches <= 64, 1 <= continuations <= 64")
        if self.delta < 1 or not 0.0 <= self.quantile <= 1.0 or self.min_distance < 0:
            raise ModeError("tree needs delta >= 1, 0 <= quantile <= 1, min_distance >= 0")
        if not self.separator or not self.fallback_separator:
            raise ModeError("step separators must be non-empty")


# ------------------------------------------------------------------------------------------------
# pure pieces: steps, branch-point strategies, expansion


def split_steps(
    token_texts: Sequence[str], separator: str = "\n\n", fallback: str = "\n", end_token: int | None = None
) -> list[tuple[int, int]]:
    """Token spans [start, end) of a response's steps: a step ends after each token whose text completes
    ``separator`` (a separator may straddle tokens); ``fallback`` is used when ``separator`` leaves
    fewer than 3 steps up to ``end_token`` (the end-of-thinking token: steps from it on never branch;
    default the end), i.e. no interior step to branch at, and ``fallback`` gives more."""
    if not token_texts:
        return []
    ends, pos = [], 0
    for t in token_texts:
        pos += len(t)
        ends.append(pos)  # ends[i] = char offset just after token i
    text = "".join(token_texts)

    def cuts_of(sep: str) -> list[int]:
        found = {bisect.bisect_left(ends, m.end()) + 1 for m in re.finditer(re.escape(sep), text)}
        return sorted(c for c in found if 0 < c < len(token_texts))

    def before_end(cuts: list[int]) -> int:
        return len(cuts) if end_token is None else sum(c <= end_token for c in cuts)

    cuts = cuts_of(separator)
    if before_end(cuts) < 2:
        more = cuts_of(fallback)
        cuts = more if before_end(more) > before_end(cuts) else cuts
    bounds = [0, *cuts, len(token_texts)]
    return [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def first_token_containing(token_texts: Sequence[str], needle: str) -> int | None:
    """Index of the token where the first ``needle`` begins (it may straddle tokens), or None."""
    at = "".join(token_texts).find(needle)
    if at < 0:
        return None
    pos = 0
    for i, t in enumerate(token_texts):
        pos += len(t)
        if pos > at:
            return i
    return None


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return 0.0
    h = (len(xs) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (h - lo)


def spaced(positions: Sequence[int], n: int, min_distance: int) -> list[int]:
    """The first ``n`` of ``positions`` (in the given order) each >= min_distance tokens from those taken."""
    taken: list[int] = []
    for p in positions:
        if len(taken) >= n:
            break
        if all(abs(p - t) >= min_distance for t in taken):
            taken.append(p)
    return sorted(taken)


def attention_branch_points(
    fci: Sequence[float], steps: Sequence[tuple[int, int]], n: int, q: float = 0.8, min_distance: int = 512
) -> list[int]:
    """AttnRL ATB (eq. 7 + "N earliest"): completion offsets of the branch steps.

    ``fci[s]`` scores response step ``steps[s]`` (already zeroed by the rules, so 0 = ineligible);
    candidates are eligible steps with FCI >= the ``q``-quantile of the eligible scores."""
    eligible = [s for s, v in enumerate(fci) if v > 0.0 and steps[s][0] > 0]
    if not eligible:
        return []
    threshold = quantile([fci[s] for s in eligible], q)
    candidates = [s for s in eligible if fci[s] >= threshold]  # ascending step index = earliest first
    return spaced([steps[s][0] for s in candidates], n, min_distance)


def entropy_mask(
    token_texts: Sequence[str], stop_words: Sequence[str] = ("answer", "conclusion")
) -> list[bool]:
    """TreeRL's eligible tokens: not the first token of the response, nothing from the first token whose
    text contains a stop word (case-insensitive) on."""
    ok = [True] * len(token_texts)
    if ok:
        ok[0] = False
    lowered = [t.lower() for t in token_texts]
    cut = min(
        (i for w in stop_words if (i := first_token_containing(lowered, w.lower())) is not None),
        default=None,
    )
    if cut is not None:
        for i in range(cut, len(ok)):
            ok[i] = False
    return ok


def entropy_branch_points(
    logprobs: Sequence[float], eligible: Sequence[bool], n: int, min_distance: int = 0
) -> list[int]:
    """TreeRL: the ``n`` eligible tokens with the highest -log-prob (ties: earliest first)."""
    order = sorted((i for i, ok in enumerate(eligible) if ok), key=lambda i: (logprobs[i], i))
    return spaced(order, n, min_distance)


def random_branch_points(
    steps: Sequence[tuple[int, int]],
    n: int,
    rng: random.Random,
    min_distance: int = 0,
    zero_from: int | None = None,
) -> list[int]:
    """Baseline: ``n`` random step starts (never the first step nor steps from ``zero_from`` on)."""
    starts = [a for s, (a, _) in enumerate(steps) if a > 0 and (zero_from is None or s + 1 < zero_from)]
    rng.shuffle(starts)
    return spaced(starts, n, min_distance)


def expanded_trees(
    initial: int,
    correct: Sequence[float] | None,
    rule: str = "round",
    mean_fci: float | None = None,
    running_mean: float | None = None,
) -> tuple[int, bool]:
    """(M, filtered): AttnRL eq. 9 M = Round(exp(-z) M') with z the initial accuracy (``ceil``: the
    authors' ceil(exp(-i/n) n)); eq. 8: an all-correct prompt whose mean FCI is below the running
    mean is filtered (M = 0). No correctness or ``rule="all"``: M = M'."""
    if correct is None or rule == "all" or not correct:
        return initial, False
    z = sum(correct) / len(correct)
    if z >= 1.0 and mean_fci is not None and running_mean is not None and mean_fci < running_mean:
        return 0, True
    m = math.exp(-z) * initial
    return min(initial, math.ceil(m) if rule == "ceil" else math.floor(m + 0.5)), False


# ------------------------------------------------------------------------------------------------
# reward callback and attention scorers


def exact_reward_fn(request: RolloutRequest, tokenizer: Any) -> RewardFn | None:
    """Correctness by loom.exact for ``arithmetic`` (label = the value) and ``countdown`` (label = JSON
    {"numbers": [...], "target": n}) requests; None for every other task (no expansion rule then)."""
    from loom.exact import check_arithmetic, check_countdown
    from loom.tiny.traces import extract_boxed

    label = request.label
    if request.task not in ("arithmetic", "countdown") or not label:
        return None
    gold: Any = label
    if request.task == "countdown":
        try:
            spec = json.loads(label)
            gold = ([int(n) for n in spec["numbers"]], int(spec["target"]))
        except (ValueError, KeyError, TypeError):
            return None

    def score(trajectories: list[Trajectory]) -> list[float]:
        out = []
        for t in trajectories:
            text = tokenizer.decode(t.completion_ids, skip_special_tokens=True)
            answer = extract_boxed(text)
            if answer is None:
                out.append(0.0)
            elif request.task == "arithmetic":
                out.append(float(check_arithmetic(answer, gold)))
            else:
                out.append(float(check_countdown(answer, gold[0], gold[1])))
        return out

    return score


def http_scorer(url: str, timeout_s: float = 120.0) -> Scorer:
    """FCI scores from ``POST {url}/v1/score/attention`` (the learner's route, also on ``loom engine``)."""
    import httpx

    async def score(
        ids: list[int], steps: list[tuple[int, int]], delta: int, zero_from: int | None
    ) -> list[float]:
        body = {"token_ids": ids, "steps": [list(s) for s in steps], "delta": delta, "zero_from": zero_from}
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.post(url.rstrip("/") + "/v1/score/attention", json=body)
        if r.status_code != 200:
            raise ModeError(f"attention scorer at {url} answered {r.status_code}: {r.text[:200]}")
        return [float(x) for x in r.json()["scores"]]

    return score


def resolve_scorer(engine: Engine, cfg: TreeConfig) -> Scorer:
    if "attention_scores" in engine.capabilities:
        return engine.score_attention
    if cfg.attention_url:
        return http_scorer(cfg.attention_url, cfg.attention_timeout_s)
    raise UnsupportedCapability(
        engine.name,
        "attention_scores",
        "use strategy 'entropy' or 'random', or set mode_params.attention_url to a learner / `loom engine`",
    )


# ------------------------------------------------------------------------------------------------
# the mode


@dataclass
class _Response:
    """One initial response and what the strategies need about it."""

    index: int
    c: Completion
    texts: list[str]
    steps: list[tuple[int, int]]
    zero_from: int | None  # first step index (1-based, step 0 = prompt) scored 0
    fci: list[float] | None = None  # per response step (zeroed)


async def _call(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


def _texts(tokenizer: Any, ids: Sequence[int], cache: dict[int, str]) -> list[str]:
    out = []
    for t in ids:
        if t not in cache:
            cache[t] = tokenizer.decode([t], skip_special_tokens=False)
        out.append(cache[t])
    return out


async def tree(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: TreeConfig,
    reward_fn: RewardFn | None = None,
    scorer: Scorer | None = None,
) -> Group:
    """One prompt's tree (module docstring). ``scorer`` overrides the engine's attention scorer."""
    needs_fci = cfg.strategy == "attention" or cfg.fci_running_mean is not None
    if needs_fci and scorer is None:
        scorer = resolve_scorer(engine, cfg)
    sampling = request.sampling
    t0 = time.perf_counter()
    outs = await engine.generate(prompt_ids, sampling.model_copy(update={"n": cfg.initial}))
    t_initial = time.perf_counter() - t0
    cache: dict[int, str] = {}
    responses = []
    for i, c in enumerate(outs):
        texts = _texts(tokenizer, c.token_ids, cache)
        end = first_token_containing(texts, cfg.end_marker) if cfg.end_marker else None
        steps = split_steps(texts, cfg.separator, cfg.fallback_separator, end)
        zero_from = None
        if end is not None:
            zero_from = 1 + next(s for s, (a, b) in enumerate(steps) if a <= end < b)
        responses.append(_Response(i, c, texts, steps, zero_from))

    def base(i: int, c: Completion) -> Trajectory:
        return Trajectory(
            id=trajectory_id(group_id, i),
            group_id=group_id,
            prompt_ids=list(prompt_ids),
            completion_ids=list(c.token_ids),
            logprobs=list(c.logprobs),
            logprobs_kind=engine.logprobs_kind,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            policy_version=engine.policy_version,
            engine=engine.name,
            timing={"generate_s": t_initial},
        )

    initial = [base(r.index, r.c) for r in responses]
    correct = [float(x) for x in await _call(reward_fn, initial)] if reward_fn is not None else None

    if needs_fci and scorer is not None:
        p = len(prompt_ids)
        for r in responses:
            if not r.steps:
                r.fci = []
                continue
            spans = [(0, p)] + [(p + a, p + b) for a, b in r.steps]
            scores = await scorer(list(prompt_ids) + list(r.c.token_ids), spans, cfg.delta, r.zero_from)
            r.fci = [float(x) for x in scores[1:]]
    mean_fci = None
    if needs_fci:
        per = [sum(r.fci) / len(r.fci) for r in responses if r.fci]
        mean_fci = sum(per) / len(per) if per else 0.0  # eq. 8's per-prompt score
    m, filtered = expanded_trees(cfg.initial, correct, cfg.expansion, mean_fci, cfg.fci_running_mean)

    rng = random.Random(sampling.seed)
    points: dict[int, list[int]] = {}
    for r in responses[:m]:
        if cfg.strategy == "attention":
            pts = attention_branch_points(r.fci or [], r.steps, cfg.branches, cfg.quantile, cfg.min_distance)
        elif cfg.strategy == "entropy":
            mask = entropy_mask(r.texts, cfg.entropy_stop_words)
            pts = entropy_branch_points(r.c.logprobs, mask, cfg.branches, cfg.min_distance)
        else:
            pts = random_branch_points(r.steps, cfg.branches, rng, cfg.min_distance, r.zero_from)
        points[r.index] = [b for b in pts if 0 < b < len(r.c.token_ids)]

    async def branch(r: _Response, k: int, b: int) -> tuple[int, int, int, list[Completion], float]:
        params = sampling.model_copy(
            update={
                "n": cfg.continuations,
                "max_tokens": max(1, sampling.max_tokens - b),
                "seed": sample_seed(sampling.seed, r.index, k + 1),
            }
        )
        t1 = time.perf_counter()
        cont = await engine.generate(list(prompt_ids) + list(r.c.token_ids[:b]), params)
        return r.index, k, b, cont, time.perf_counter() - t1

    jobs = [branch(responses[i], k, b) for i, pts in points.items() for k, b in enumerate(pts)]
    branched = await asyncio.gather(*jobs)

    # tree nodes: response i is the chain i.0 -> i.1 -> ... cut at its branch points
    nodes: list[TreeNode] = []
    chain: dict[int, list[TreeNode]] = {}
    for t, r in zip(initial, responses, strict=True):
        cuts = [0, *points.get(r.index, []), len(r.c.token_ids)]
        parent = None
        chain[r.index] = []
        for d, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
            node = TreeNode(id=f"{t.id}:{d}", parent=parent, trajectory_id=t.id, start=a, end=b)
            nodes.append(node)
            chain[r.index].append(node)
            parent = node.id
    trajectories = list(initial)
    generated = sum(len(r.c.token_ids) for r in responses)
    for i, k, b, cont, dt in branched:
        r = responses[i]
        for j, c in enumerate(cont):
            tid = f"{trajectory_id(group_id, i)}.b{k}.{j}"
            node = TreeNode(
                id=f"{tid}:0", parent=chain[i][k].id, trajectory_id=tid, start=b, end=b + len(c.token_ids)
            )
            nodes.append(node)
            generated += len(c.token_ids)
            trajectories.append(
                Trajectory(
                    id=tid,
                    group_id=group_id,
                    prompt_ids=list(prompt_ids),
                    completion_ids=list(r.c.token_ids[:b]) + list(c.token_ids),
                    logprobs=list(r.c.logprobs[:b]) + list(c.logprobs),
                    logprobs_kind=engine.logprobs_kind,
                    loss_mask=[int(cfg.train_prefix)] * b + [1] * len(c.token_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    policy_version=engine.policy_version,
                    engine=engine.name,
                    timing={"generate_s": dt},
                    parent_id=trajectory_id(group_id, i),
                    meta={"branch_point": b, "branch_index": k, "strategy": cfg.strategy},
                )
            )
    by_id = {n.id: n for n in nodes}
    for t in trajectories:
        own = [n for n in nodes if n.trajectory_id == t.id]
        path: list[TreeNode] = []
        cur: str | None = own[-1].id if own else None
        while cur is not None:
            path.append(by_id[cur])
            cur = by_id[cur].parent
        t.segments = [
            Segment(kind="tree_node", start=n.start, end=n.end, index=d, meta={"node": n.id})
            for d, n in enumerate(reversed(path))
            if n.end > n.start
        ]
    if correct is not None:
        for t, ok in zip(initial, correct, strict=True):
            t.meta["initial_correct"] = ok
    independent = sum(len(t.completion_ids) for t in trajectories)
    meta: dict[str, Any] = {
        "strategy": cfg.strategy,
        "initial": cfg.initial,
        "expanded": m,
        "filtered": filtered,
        "accuracy": None if correct is None else sum(correct) / len(correct),
        "mean_fci": mean_fci,
        "fci": {t.id: r.fci for t, r in zip(initial, responses, strict=True) if r.fci is not None},
        "branch_points": {trajectory_id(group_id, i): pts for i, pts in points.items()},
        "n_leaves": len(trajectories),
        "tokens_generated": generated,
        "tokens_independent": independent,
        "token_ratio": generated / independent if independent else 1.0,
        "generate_s": time.perf_counter() - t0,
    }
    return Group(
        id=group_id,
        mode="tree",
        prompt=request.prompt,
        label=request.label,
        task=request.task,
        trajectories=trajectories,
        tree=nodes,
        meta=meta,
    )


async def run(
    request: RolloutRequest, prompt_ids: list[int], group_id: str, engine: Engine, tokenizer: Any
) -> Group:
    """The dispatch entry: config from ``mode_params``, the exact-verifier reward when the task has one."""
    cfg = TreeConfig.from_request(request)
    return await tree(
        request, prompt_ids, group_id, engine, tokenizer, cfg, exact_reward_fn(request, tokenizer)
    )
