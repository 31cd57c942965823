"""tree (docs/algorithms.md §2.3; TreeRL, AttnRL §3.1-3.2 and appendix E): branch sampled responses.

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
     response step and the steps after ``</think>`` score 0 (``zero_from_step``: the step the marker
     ends is the last thinking step); candidates are the eligible steps with
     FCI >= the 0.8-quantile of eligible scores (eq. 7, quantile over non-zeroed steps, > 0 only);
     the N earliest (default 2) at least ``min_distance`` tokens apart (default 512);
   - ``entropy`` (TreeRL): the N tokens with the highest -log-prob of the sampled token, masking the
     first token of the response and everything from the first token containing "answer" or
     "conclusion"; same ``min_distance`` rule;
   - ``random``: N random step starts (never the first step), same ``min_distance`` rule.
5. Branch: prompt + response[:branch start] -> T continuations (default 2), one engine call with n=T,
   so a prefix-caching engine computes only the new tokens.
6. ``iterations`` L (default 1; TreeRL's EPTree rounds): round l > 1 picks N more points per tree,
   pooled over every path of the tree (each path's own tokens, after its branch point, never a point
   already taken; ranked by the same strategy) and branches each into T continuations; a tree then
   has 1 + L N T leaves.

Reward callback (``reward_fn``: correctness in [0, 1] per initial response) and attention scorer
(``scorer``: the operator's, for an engine without its own) are plain callables, so the mode stays
pure; rollout_svc.modes.scorers builds them (the exact verifier, ``LOOM_ATTENTION_URL``) and holds
the scorer's transport and security rules.

The group records the tree: trajectory i is the initial response i or a branch (its completion is the
copied prefix + the continuation, ``parent_id`` = the path it branched from); ``Group.tree`` holds
nodes with parents and completion-token spans; every trajectory has a ``tree_node`` segment per node
on its path. learner.estimators.treerl computes node advantages from exactly this.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from loom.contracts.modes import TreeParams
from loom.contracts.wire import Group, RolloutRequest, SamplingParams, Segment, Trajectory, TreeNode
from rollout_svc.engines.base import Completion, Engine
from rollout_svc.modes import group_of, sample_seed, sampled, trajectory_id
from rollout_svc.modes.scorers import PolicyScorer, RewardFn, Scorer, resolve_scorer

Strategy = Literal["attention", "entropy", "random"]


# ------------------------------------------------------------------------------------------------
# pure pieces: steps, branch-point strategies, expansion


def split_steps(
    token_texts: Sequence[str], separator: str = "\n\n", fallback: str = "\n", end_token: int | None = None
) -> list[tuple[int, int]]:
    """Token spans [start, end) of a response's steps: a step ends after each token whose text completes
    ``separator`` (a separator may straddle tokens); ``fallback`` is used when ``separator`` leaves
    fewer than 3 steps up to ``end_token`` (the end-of-thinking token; default the end), i.e. no
    interior step before the marker's own to branch at, and ``fallback`` gives more."""
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


def zero_from_step(steps: Sequence[tuple[int, int]], end_token: int | None) -> int | None:
    """The scorer's ``zero_from`` (step index, 1-based: step 0 is the prompt): the first response step
    that starts at or after the end-of-thinking token, so the steps after the marker score 0 and never
    branch. The step the marker ends (it starts before the marker, as the last paragraph of an
    R1-style ``...\\n</think>\\n\\n`` does) is the last thinking step and stays eligible. None
    without a marker."""
    if end_token is None:
        return None
    return 1 + next((s for s, (a, _) in enumerate(steps) if a >= end_token), len(steps))


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


# A candidate branch point is (path, position): ``path`` is a key (an index, or a tree's path), the
# position a completion offset. One response is the one-path case.
Point = tuple[Any, int]


def spaced_points(
    ranked: Sequence[Point], n: int, min_distance: int, taken: dict[Any, list[int]] | None = None
) -> list[Point]:
    """The first ``n`` of ``ranked`` (in the given order), each >= ``min_distance`` tokens from the
    points already on its path (``taken``, and those picked here)."""
    near = {k: list(v) for k, v in (taken or {}).items()}
    picked: list[Point] = []
    for key, pos in ranked:
        if len(picked) >= n:
            break
        if all(abs(pos - t) >= min_distance for t in near.get(key, ())):
            picked.append((key, pos))
            near.setdefault(key, []).append(pos)
    return picked


def attention_ranked(scored: Sequence[tuple[Any, float, int]], q: float) -> list[Point]:
    """AttnRL eq. 7 + "N earliest": ``scored`` = (path, FCI, step start) of the eligible steps; the
    candidates (FCI >= the ``q``-quantile of all of them), earliest first (ties: ``scored``'s order)."""
    if not scored:
        return []
    threshold = quantile([v for _, v, _ in scored], q)
    cands = sorted((x for x in scored if x[1] >= threshold), key=lambda x: x[2])  # stable: ties keep order
    return [(k, pos) for k, _, pos in cands]


def entropy_ranked(scored: Sequence[tuple[Any, float, int]]) -> list[Point]:
    """TreeRL: ``scored`` = (path, log-prob, position) of the eligible tokens; highest -log-prob first
    (ties: ``scored``'s order)."""
    return [(k, pos) for k, _, pos in sorted(scored, key=lambda x: x[1])]  # stable: ties keep order


def attention_branch_points(
    fci: Sequence[float], steps: Sequence[tuple[int, int]], n: int, q: float = 0.8, min_distance: int = 512
) -> list[int]:
    """AttnRL ATB (eq. 7 + "N earliest"): completion offsets of the branch steps.

    ``fci[s]`` scores response step ``steps[s]`` (already zeroed by the rules, so 0 = ineligible);
    candidates are eligible steps with FCI >= the ``q``-quantile of the eligible scores."""
    scored = [(0, v, steps[s][0]) for s, v in enumerate(fci) if v > 0.0 and steps[s][0] > 0]
    return sorted(pos for _, pos in spaced_points(attention_ranked(scored, q), n, min_distance))


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
    scored = [(0, logprobs[i], i) for i, ok in enumerate(eligible) if ok]
    return sorted(pos for _, pos in spaced_points(entropy_ranked(scored), n, min_distance))


def random_branch_points(
    steps: Sequence[tuple[int, int]],
    n: int,
    rng: random.Random,
    min_distance: int = 0,
    zero_from: int | None = None,
) -> list[int]:
    """Baseline: ``n`` random step starts (never the first step nor steps from ``zero_from`` on)."""
    starts: list[Point] = [
        (0, a) for s, (a, _) in enumerate(steps) if a > 0 and (zero_from is None or s + 1 < zero_from)
    ]
    rng.shuffle(starts)
    return sorted(pos for _, pos in spaced_points(starts, n, min_distance))


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
# the mode


@dataclass
class _Path:
    """One sampled path of a tree: an initial response (``start`` 0) or a continuation, whose
    completion is the copied prefix ``[0, start)`` of ``parent`` + its own tokens; and what the
    strategies need about it."""

    tid: str
    index: int  # position among the group's paths (initial responses first): its branches' seeds
    tree: int  # index of the initial response the path grows from
    c: Completion  # the whole completion (copied prefix + own tokens)
    texts: list[str]
    steps: list[tuple[int, int]]
    zero_from: int | None  # first step index (1-based, step 0 = prompt) scored 0
    start: int = 0
    parent: _Path | None = None
    iteration: int = 0  # the expansion round that sampled it (0: initial sampling)
    branch_index: int = 0
    seconds: float = 0.0
    fci: list[float] | None = None  # per step (zeroed)
    cuts: list[int] = field(default_factory=list)  # its own branch points, in the order taken


async def _call(fn: Any, *args: Any) -> Any:
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


def decoded_tokens(tokenizer: Any, ids: Sequence[int], cache: dict[int, str]) -> list[str]:
    """Each id's own text (special tokens kept: stop words are matched on them), decoded once per
    id through ``cache``."""
    out = []
    for t in ids:
        if t not in cache:
            cache[t] = tokenizer.decode([t], skip_special_tokens=False)
        out.append(cache[t])
    return out


def _pick(paths: Sequence[_Path], cfg: TreeParams, rng: random.Random) -> list[tuple[_Path, int]]:
    """Branch points of one tree in one expansion round, pooled over ``paths`` (the tree's paths):
    candidates are each path's own positions (after its ``start``, never a point already taken), ranked
    by the strategy's rule (``attention_ranked``, ``entropy_ranked``, shuffled step starts for random)
    and spaced by ``spaced_points``: the rules of ``attention_branch_points`` /
    ``entropy_branch_points`` / ``random_branch_points``, which are the one-path case (round 1)."""
    ranked: list[Point]
    if cfg.strategy == "attention":
        scored = [
            (k, v, p.steps[s][0])
            for k, p in enumerate(paths)
            for s, v in enumerate(p.fci or [])
            if v > 0.0 and p.start < p.steps[s][0] and p.steps[s][0] not in p.cuts
        ]
        ranked = attention_ranked(scored, cfg.quantile)
    elif cfg.strategy == "entropy":
        tokens = []
        for k, p in enumerate(paths):
            mask = entropy_mask(p.texts, cfg.entropy_stop_words)
            tokens += [
                (k, p.c.logprobs[i], i) for i, ok in enumerate(mask) if ok and i > p.start and i not in p.cuts
            ]
        ranked = entropy_ranked(tokens)
    else:
        ranked = [
            (k, a)
            for k, p in enumerate(paths)
            for s, (a, _) in enumerate(p.steps)
            if a > p.start and a not in p.cuts and (p.zero_from is None or s + 1 < p.zero_from)
        ]
        rng.shuffle(ranked)
    ranked = [(k, b) for k, b in ranked if 0 < b < len(paths[k].c.token_ids)]
    taken = {k: list(p.cuts) for k, p in enumerate(paths)}
    picked = spaced_points(ranked, cfg.branches, cfg.min_distance, taken)
    return [(paths[k], b) for k, b in sorted(picked)]


@dataclass
class _Grower:
    """One prompt's tree: what its paths share (prompt, engine, tokenizer, params, scorer, sampling)
    and the steps that grow it: analyse a sampled path, score it, branch it, record it as a
    trajectory."""

    prompt_ids: list[int]
    group_id: str
    engine: Engine
    tokenizer: Any
    cfg: TreeParams
    scorer: Scorer | None
    sampling: SamplingParams
    cache: dict[int, str] = field(default_factory=dict)  # token id -> text

    async def sample_initial(self) -> list[_Path]:
        """Step 1: the M' initial responses, each analysed into steps."""
        t0 = time.perf_counter()
        outs = await self.engine.generate(
            self.prompt_ids, self.sampling.model_copy(update={"n": self.cfg.initial})
        )
        t_initial = time.perf_counter() - t0
        return [
            self.analysed(trajectory_id(self.group_id, i), i, i, c, seconds=t_initial)
            for i, c in enumerate(outs)
        ]

    def analysed(self, tid: str, index: int, tree_index: int, c: Completion, **kw: Any) -> _Path:
        """Step 2: a sampled path split into steps, with the end-of-thinking step."""
        cfg = self.cfg
        texts = decoded_tokens(self.tokenizer, c.token_ids, self.cache)
        end = first_token_containing(texts, cfg.end_marker) if cfg.end_marker else None
        steps = split_steps(texts, cfg.separator, cfg.fallback_separator, end)
        return _Path(tid, index, tree_index, c, texts, steps, zero_from_step(steps, end), **kw)

    async def score(self, p: _Path) -> None:
        """FCI of each of ``p``'s steps (once; the prompt is step 0)."""
        if p.fci is not None or self.scorer is None:
            return
        if not p.steps:
            p.fci = []
            return
        n = len(self.prompt_ids)
        spans = [(0, n)] + [(n + a, n + b) for a, b in p.steps]
        scores = await self.scorer(
            list(self.prompt_ids) + list(p.c.token_ids), spans, self.cfg.delta, p.zero_from
        )
        p.fci = [float(x) for x in scores[1:]]

    async def mean_fci(self, responses: list[_Path]) -> float:
        """AttnRL eq. 8's per-prompt score: the mean over the responses of their mean step FCI."""
        if self.scorer is not None:
            for p in responses:
                await self.score(p)
        per = [sum(p.fci) / len(p.fci) for p in responses if p.fci]
        return sum(per) / len(per) if per else 0.0

    async def expand(self, responses: list[_Path], m: int) -> list[_Path]:
        """Steps 4-6: the first ``m`` trees branched for ``iterations`` rounds; every path, initial first."""
        rng = random.Random(self.sampling.seed)
        paths: list[_Path] = list(responses)
        trees: dict[int, list[_Path]] = {p.tree: [p] for p in responses[:m]}
        for it in range(self.cfg.iterations):
            jobs = []
            for tree_paths in trees.values():
                if self.cfg.strategy == "attention" and it > 0:
                    for q in tree_paths:
                        await self.score(q)
                for p, b in _pick(tree_paths, self.cfg, rng):
                    jobs.append(self.branch(p, len(p.cuts), b))
                    p.cuts.append(b)
            if not jobs:
                break
            for p, k, b, cont, dt in await asyncio.gather(*jobs):
                for j, c in enumerate(cont):
                    child = self.continued(p, k, b, j, c, it + 1, dt, len(paths))
                    paths.append(child)
                    trees[p.tree].append(child)
        return paths

    async def branch(self, p: _Path, k: int, b: int) -> tuple[_Path, int, int, list[Completion], float]:
        """Step 5: T continuations of ``p``'s first ``b`` tokens (one engine call, n = T)."""
        sampling = self.sampling
        params = sampling.model_copy(
            update={
                "n": self.cfg.continuations,
                "max_tokens": max(1, sampling.max_tokens - b),
                "seed": sample_seed(sampling.seed, p.index, k + 1),
            }
        )
        t1 = time.perf_counter()
        cont = await self.engine.generate(list(self.prompt_ids) + list(p.c.token_ids[:b]), params)
        return p, k, b, cont, time.perf_counter() - t1

    def continued(
        self, p: _Path, k: int, b: int, j: int, c: Completion, iteration: int, dt: float, index: int
    ) -> _Path:
        """Continuation ``j`` of ``p``'s branch ``k`` at ``b``: the copied prefix + its own tokens."""
        whole = Completion(
            token_ids=list(p.c.token_ids[:b]) + list(c.token_ids),
            logprobs=list(p.c.logprobs[:b]) + list(c.logprobs),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        return self.analysed(
            f"{p.tid}.b{k}.{j}",
            index,
            p.tree,
            whole,
            start=b,
            parent=p,
            iteration=iteration,
            branch_index=k,
            seconds=dt,
        )

    def trajectory(self, p: _Path) -> Trajectory:
        cfg, engine = self.cfg, self.engine
        t = sampled(
            engine,
            p.tid,
            self.group_id,
            self.prompt_ids,
            completion_ids=list(p.c.token_ids),
            logprobs=list(p.c.logprobs),
            finish_reason=p.c.finish_reason,
            stop_reason=p.c.stop_reason,
            timing={"generate_s": p.seconds},
        )
        if p.parent is not None:
            t.loss_mask = [int(cfg.train_prefix)] * p.start + [1] * (len(p.c.token_ids) - p.start)
            t.parent_id = p.parent.tid
            t.meta = {"branch_point": p.start, "branch_index": p.branch_index, "strategy": cfg.strategy}
            fci = _fci_at(p.parent, p.start)
            if fci is not None:  # the attention score of the step this branch starts (AttnRL eq. 6)
                t.meta["branch_fci"] = fci
            if cfg.iterations > 1:
                t.meta["iteration"] = p.iteration
        return t


def _fci_at(p: _Path, start: int) -> float | None:
    """The FCI of ``p``'s step that begins at token ``start`` (None: no scores, or no step begins there)."""
    if not p.fci:
        return None
    for s, (a, _) in enumerate(p.steps[: len(p.fci)]):
        if a == start:
            return p.fci[s]
    return None


def tree_nodes(
    paths: Sequence[Any], length: Callable[[Any], int]
) -> tuple[list[TreeNode], dict[tuple[str, int], str]]:
    """The tree's nodes and (path, end offset) -> node id: a path (``tid``, ``start``, ``cuts``,
    ``parent``; ``length(path)`` its completion's length) is the chain of its own spans cut at its
    branch points; its first node hangs from the parent's node that ends at its branch point. Tree
    mode's paths and agent_tree's episodes (rollout_svc/modes/agent_tree.py) share it."""
    nodes: list[TreeNode] = []
    node_at: dict[tuple[str, int], str] = {}
    for p in paths:
        bounds = [p.start, *sorted(p.cuts), length(p)]
        parent = None if p.parent is None else node_at[(p.parent.tid, p.start)]
        for d, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            node = TreeNode(id=f"{p.tid}:{d}", parent=parent, trajectory_id=p.tid, start=a, end=b)
            nodes.append(node)
            node_at[(p.tid, b)] = node.id
            parent = node.id
    return nodes, node_at


def _node_segments(
    trajectories: list[Trajectory], nodes: list[TreeNode], node_at: dict[tuple[str, int], str]
) -> None:
    """Each trajectory's ``tree_node`` segments: one per non-empty node on its path, root first."""
    by_id = {n.id: n for n in nodes}
    for t in trajectories:
        path: list[TreeNode] = []
        cur: str | None = node_at.get((t.id, len(t.completion_ids)))  # its deepest node
        while cur is not None:
            path.append(by_id[cur])
            cur = by_id[cur].parent
        t.segments = [
            Segment(kind="tree_node", start=n.start, end=n.end, index=d, meta={"node": n.id})
            for d, n in enumerate(reversed(path))
            if n.end > n.start
        ]


# what tree() takes beyond (request, prompt_ids, group_id, engine), in its order
# (rollout_svc.modes.PROVIDERS gives each)
NEEDS = ("tokenizer", "params", "reward_fn", "scorer")


async def tree(
    request: RolloutRequest,
    prompt_ids: list[int],
    group_id: str,
    engine: Engine,
    tokenizer: Any,
    cfg: TreeParams,
    reward_fn: RewardFn | None = None,
    scorer: PolicyScorer | None = None,
) -> Group:
    """One prompt's tree (module docstring). ``scorer``: the operator's attention scorer, used when the
    engine has none of its own (for the policy the engine serves: the rollout's)."""
    needs_fci = cfg.strategy == "attention" or cfg.fci_running_mean is not None
    scoring = resolve_scorer(engine, scorer) if needs_fci else None
    grower = _Grower(prompt_ids, group_id, engine, tokenizer, cfg, scoring, request.sampling)
    t0 = time.perf_counter()
    responses = await grower.sample_initial()
    initial = [grower.trajectory(p) for p in responses]
    correct = [float(x) for x in await _call(reward_fn, initial)] if reward_fn is not None else None
    mean_fci = await grower.mean_fci(responses) if needs_fci else None
    m, filtered = expanded_trees(cfg.initial, correct, cfg.expansion, mean_fci, cfg.fci_running_mean)
    paths = await grower.expand(responses, m)
    nodes, node_at = tree_nodes(paths, lambda p: len(p.c.token_ids))
    trajectories = initial + [grower.trajectory(p) for p in paths[len(responses) :]]
    _node_segments(trajectories, nodes, node_at)
    if correct is not None:
        for t, ok in zip(initial, correct, strict=True):
            t.meta["initial_correct"] = ok
    generated = sum(len(p.c.token_ids) - p.start for p in paths)
    independent = sum(len(t.completion_ids) for t in trajectories)
    meta: dict[str, Any] = {
        "strategy": cfg.strategy,
        "initial": cfg.initial,
        "expanded": m,
        "filtered": filtered,
        "iterations": cfg.iterations,
        "accuracy": None if correct is None else sum(correct) / len(correct),
        "mean_fci": mean_fci,
        "fci": {p.tid: p.fci for p in paths if p.fci is not None},
        "branch_points": {p.tid: sorted(p.cuts) for p in paths if p.cuts},
        "n_leaves": len(trajectories),
        "tokens_generated": generated,
        "tokens_independent": independent,
        "token_ratio": generated / independent if independent else 1.0,
        "generate_s": time.perf_counter() - t0,
    }
    return group_of(
        request,
        group_id,
        "tree",
        trajectories,
        tree=nodes,
        meta=meta,
    )
