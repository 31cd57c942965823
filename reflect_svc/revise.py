"""Revised samples (REA-RL §4.2, eq. 2; docs/algorithms.md §3): detect, cut, complete, score, keep or discard.

For every trajectory of a group: chunk its thinking part, let the detector pick the cut, move the cut
so that at most ``max_removed_fraction`` (1/2) of the thinking tokens go, then ask the policy to
complete ``prefix + forced ending`` with a short budget. Originals and revisions are scored together;
a revision is discarded when the original was correct and the revision is not, and when both are
wrong (loom.revisions). Kept revisions join the group right after their original, with ``parent_id``
= the original's id, a ``revision`` segment and ``meta``.

The pieces call no service: ``plan_revisions`` (the cuts and their rollout requests; the gold
detector's chunk texts first, to be matched) and ``assemble_revisions`` (the drafts). The gateway's RL
step runs them as stages between its own generation and its one score (gateway/step.py);
``revise_group`` runs the whole for ``/v1/reflect`` over a ``Services`` object (rollout, reward, the
reflection model).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from loom.contracts.wire import (
    Group,
    ReflectParams,
    ReflectResult,
    RevisionCut,
    RevisionInfo,
    RevisionPlan,
    RewardResult,
    RewardSpec,
    RolloutRequest,
    SamplingParams,
    Segment,
    Trajectory,
)
from loom.formats import DEFAULT_MARKERS, MarkerError, Markers, encode_with_markers
from loom.revisions import is_correct, keep_revision, keep_revisions, reflect_meta
from loom.vocab import outside_vocabulary
from reflect_svc.chunking import Thinking, chunk_thinking
from reflect_svc.detectors import (
    Detection,
    detect_fixed,
    detect_gold,
    detect_heuristic,
    detect_model,
    model_prompt,
)


class ServiceError(RuntimeError):
    """A service the core relies on failed. ``status``: the ReflectStatus a trajectory gets
    (``verifier_error``, ``model_error``), or ``rollout_error`` / ``reward_error`` when the whole
    group fails (the API's 503)."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status


class InputError(ValueError):
    """Bad input the schemas let through (the API's 422): ``loc`` is its field path in the
    request (``group``, ``params``)."""

    def __init__(self, loc: list[str | int], msg: str) -> None:
        super().__init__(f"{'.'.join(map(str, loc))}: {msg}")
        self.loc = loc
        self.msg = msg


class ModelLabels(Protocol):
    @property
    def text(self) -> str: ...

    @property
    def tokens(self) -> list[str] | None: ...

    @property
    def tops(self) -> list[dict[str, float] | None] | None: ...


class Services(Protocol):
    def match(self, group: Group, texts: list[str]) -> list[bool]:
        """Does each text state the group's gold answer? (reward service; ServiceError if down)"""
        ...

    def label(self, prompt: str, n_chunks: int) -> ModelLabels:
        """The reflection model's answer to ``prompt`` (ServiceError ``model_error`` if down)."""
        ...

    def complete(self, requests: list[RolloutRequest]) -> list[Group]:
        """One generated group per request, in order (rollout service)."""
        ...

    def score(self, group: Group, spec: RewardSpec) -> RewardResult: ...


class Tokenizer(Protocol):
    def decode(self, ids: Any, **kwargs: Any) -> str: ...

    def encode(self, text: str, **kwargs: Any) -> list[int]: ...

    def __len__(self) -> int: ...  # the vocabulary, added tokens included


# --------------------------------------------------------------------------------------- pure steps


def check_input(group: Group, vocab_size: int) -> None:
    """Raise ``InputError`` for token ids the policy's tokenizer does not have (the schemas already
    refuse crossed chunk bounds and blank keywords)."""
    for i, t in enumerate(group.trajectories):
        for name in ("prompt_ids", "completion_ids"):
            ids: list[int] = getattr(t, name)
            j = outside_vocabulary(ids, vocab_size)
            if j is not None:
                raise InputError(
                    ["group", "trajectories", i, name, j],
                    f"token id {ids[j]} is outside the tokenizer's vocabulary [0, {vocab_size})",
                )


def unique_revision_id(original_id: str, taken: set[str]) -> str:
    """``<id>.rev``, else ``<id>.rev2``, ``.rev3``, ... : the first id not in ``taken`` (added to it).
    An id too long for the schema is replaced by a digest of it."""
    base = f"{original_id}.rev"
    if len(base) > 190:  # Trajectory.id holds 200 characters, with room for the counter
        base = "rev-" + hashlib.sha256(original_id.encode()).hexdigest()[:32]
    rid, n = base, 1
    while rid in taken:
        n += 1
        rid = f"{base}{n}"
    taken.add(rid)
    return rid


def limit_cut(thinking: Thinking, cut: int, max_removed_fraction: float = 0.5) -> int:
    """Never remove more than ``max_removed_fraction`` of the thinking tokens (REA-RL B.1): a cut
    before that point moves to the first chunk end at or after it."""
    keep_until = thinking.start + math.ceil(thinking.n_tokens * (1.0 - max_removed_fraction))
    if cut >= keep_until:
        return min(cut, thinking.end)
    for c in thinking.chunks:
        if c.end >= keep_until:
            return c.end
    return thinking.end


def build_revision(
    original: Trajectory,
    cut: int,
    forced_ids: list[int],
    generated: Trajectory,
    text: str | None,
    meta: dict[str, Any],
    revision_id: str | None = None,
) -> Trajectory:
    """prefix (original tokens up to ``cut``) + forced ending + the policy's completion, with id
    ``revision_id`` (default ``<original id>.rev``; ``revise_group`` keeps them unique in the group).

    The forced-ending tokens were not sampled by the policy: loss mask 0 and log-prob 0.0 there.
    """
    gen_ids = list(generated.completion_ids)
    ids = list(original.completion_ids[:cut]) + list(forced_ids) + gen_ids
    logprobs = None
    if original.logprobs is not None and generated.logprobs is not None:
        logprobs = list(original.logprobs[:cut]) + [0.0] * len(forced_ids) + list(generated.logprobs)
    prefix_mask = list(original.loss_mask[:cut]) if original.loss_mask is not None else [1] * cut
    loss_mask = prefix_mask + [0] * len(forced_ids) + [1] * len(gen_ids)
    segments = [s for s in original.segments if s.end <= cut]
    segments.append(
        Segment(
            kind="revision",
            start=cut,
            end=len(ids),
            meta={"of": original.id, "forced_end": cut + len(forced_ids), **meta},
        )
    )
    return Trajectory(
        id=revision_id if revision_id is not None else f"{original.id}.rev",
        group_id=original.group_id,
        prompt_ids=list(original.prompt_ids),
        completion_ids=ids,
        logprobs=logprobs,
        logprobs_kind=generated.logprobs_kind,
        logprobs_processing=generated.logprobs_processing,
        loss_mask=loss_mask,
        segments=segments,
        finish_reason=generated.finish_reason,
        stop_reason=generated.stop_reason,
        policy_version=generated.policy_version,
        policy_namespace=generated.policy_namespace,  # a trainer's version is numbered in its namespace
        engine=generated.engine,
        timing=dict(generated.timing),
        parent_id=original.id,
        text=text,
        meta={"revision_of": original.id, **meta},
    )


def _request_id(group_id: str, k: int) -> str:
    gid = f"{group_id}.rev{k}"
    if len(gid) <= 200:
        return gid
    return f"rev{k}-" + hashlib.sha256(group_id.encode()).hexdigest()[:32]


# --------------------------------------------------------------------------------------- the core


@dataclass
class _Plan:
    index: int
    traj: Trajectory
    thinking: Thinking
    cut: int
    detection: Detection


Labeler = Callable[[str, int], ModelLabels]


def plan_revisions(
    group: Group,
    params: ReflectParams,
    tokenizer: Tokenizer,
    verdicts: list[bool] | None = None,
    label: Labeler | None = None,
    markers: Markers = DEFAULT_MARKERS,
) -> RevisionPlan:
    """Chunk, detect and cut every trajectory of ``group``: the rollout requests of its revisions.

    The gold detector needs the chunks checked against the gold answer: without ``verdicts`` (one per
    text, in order) its plan holds only ``match_texts``, and the caller asks again with them. The model
    detector calls ``label`` (the reflection model; ServiceError per trajectory, as a status). Nothing
    here calls another service: the caller generates the requests and scores the revised group.
    ``InputError`` before any work for bad input.
    """
    check_input(group, len(tokenizer))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    infos: dict[int, RevisionInfo] = {}
    thinkings = _thinkings(group, params, markers, decode, infos)
    if params.detector == "gold" and verdicts is None:
        texts = [c.text for th in thinkings.values() for c in th.chunks]
        if texts:
            return RevisionPlan(match_texts=texts)
    detections = _detect(group, params, label, thinkings, decode, verdicts or [])
    plans = _plans(group, params, thinkings, detections, infos)
    # the forced ending's markers (``</think>``) as their canonical ids, whatever the tokenizer
    try:
        forced = encode_with_markers(tokenizer, params.forced_ending, markers.special_tokens())
    except MarkerError as exc:
        raise InputError(["params", "forced_ending"], str(exc)) from None
    taken = {t.id for t in group.trajectories}
    cuts, requests = [], []
    for k, p in enumerate(plans):
        rid = unique_revision_id(p.traj.id, taken)
        infos[p.index].revision_id = rid
        meta = {
            "detector": params.detector,
            "removed_tokens": p.thinking.end - p.cut,
            "think_tokens": p.thinking.n_tokens,
            "chunk": infos[p.index].chunk,
        }
        cuts.append(RevisionCut(index=p.index, cut=p.cut, forced_ids=forced, revision_id=rid, meta=meta))
        requests.append(
            RolloutRequest(
                group_id=_request_id(group.id, k),
                prompt_ids=list(p.traj.prompt_ids) + list(p.traj.completion_ids[: p.cut]) + forced,
                sampling=SamplingParams(
                    n=1,
                    max_tokens=params.max_tokens,
                    temperature=params.temperature,
                    seed=None if params.seed is None else params.seed + k,
                ),
                label=group.label,
                task=group.task,
            )
        )
    ordered = [infos[i] for i in range(len(group.trajectories))]
    return RevisionPlan(requests=requests, cuts=cuts, revisions=ordered)


def derived_text(tokenizer: Tokenizer, ids: list[int]) -> str:
    """A revision's text as the rollout service derives every trajectory's (rollout_svc.rollout.
    with_text: markers kept, since format rewards read them; pad and EOS dropped), so originals and
    revisions are scored alike."""
    specials = (getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None))
    drop = {i for i in specials if i is not None}
    return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


def assemble_revisions(
    group: Group,
    params: ReflectParams,
    plan: RevisionPlan,
    completions: Sequence[Group],
    tokenizer: Tokenizer,
) -> Group:
    """``group`` with each draft revision (prefix + forced ending + the policy's completion of
    ``plan.requests[k]``, ``completions[k]``) right after its original, and ``meta["reflect"]``;
    every original gets its derived text if it has none. The drafts are not scored yet: the keep rule
    (loom.revisions.keep_revisions) decides on the scored group."""
    if len(completions) != len(plan.cuts) or any(not g.trajectories for g in completions):
        detail = f"{len(completions)} groups for {len(plan.cuts)} requests, or one without trajectories"
        raise ServiceError("rollout_error", detail)
    originals = [
        t if t.text is not None else t.model_copy(update={"text": derived_text(tokenizer, t.completion_ids)})
        for t in group.trajectories
    ]
    drafts: dict[int, Trajectory] = {}
    for c, g in zip(plan.cuts, completions, strict=True):
        draft = build_revision(
            originals[c.index], c.cut, c.forced_ids, g.trajectories[0], None, c.meta, c.revision_id
        )
        draft.text = derived_text(tokenizer, draft.completion_ids)
        drafts[c.index] = draft
    trajectories: list[Trajectory] = []
    for i, t in enumerate(originals):
        trajectories.append(t)
        if i in drafts:
            trajectories.append(drafts[i])
    meta = {**group.meta, "reflect": reflect_meta(params.detector, plan.revisions)}
    return Group.model_validate(
        group.model_copy(update={"trajectories": trajectories, "meta": meta}).model_dump()
    )


def revise_group(
    group: Group,
    params: ReflectParams,
    services: Services,
    tokenizer: Tokenizer,
    markers: Markers = DEFAULT_MARKERS,
) -> ReflectResult:
    """The whole of it for ``/v1/reflect``: plan (the gold detector's chunks checked by
    ``services.match``), complete, assemble, score with ``params.reward``, keep; see the module
    docstring. The gateway's RL step runs the same pieces as stages of its own (gateway/step.py).

    ``InputError`` before any work for bad input; ``ServiceError`` when the rollout or the reward
    service fails (the verifier and the reflection model fail per trajectory, as a status).
    """

    def label(prompt: str, n_chunks: int) -> ModelLabels:
        return services.label(prompt, n_chunks)

    plan = plan_revisions(group, params, tokenizer, None, label, markers)
    if plan.match_texts:
        try:
            verdicts = services.match(group, plan.match_texts)
        except ServiceError as exc:  # every trajectory with thinking gets the verifier's status
            plan = plan_revisions(group, params, tokenizer, [False] * len(plan.match_texts), None, markers)
            for info in plan.revisions:
                if info.status == "no_detection":
                    info.status, info.detail = exc.status, str(exc)  # type: ignore[assignment]
            return ReflectResult(group=group, revisions=plan.revisions)
        plan = plan_revisions(group, params, tokenizer, verdicts, label, markers)
    if not plan.requests:
        meta = {**group.meta, "reflect": reflect_meta(params.detector, plan.revisions)}
        return ReflectResult(group=group.model_copy(update={"meta": meta}), revisions=plan.revisions)
    drafted = assemble_revisions(group, params, plan, services.complete(list(plan.requests)), tokenizer)
    try:
        scored, _ = keep_revisions(drafted, services.score(drafted, params.reward), params.keep_discarded)
    except ValueError as exc:
        raise ServiceError("reward_error", str(exc)) from None
    infos = [RevisionInfo.model_validate(i) for i in scored.meta["reflect"]["info"]]
    return ReflectResult(group=scored, revisions=infos)


def _thinkings(
    group: Group,
    params: ReflectParams,
    markers: Markers,
    decode: Callable[[list[int]], str],
    infos: dict[int, RevisionInfo],
) -> dict[int, Thinking]:
    """Each trajectory's thinking, chunked; one without tokens or thinking gets its status in ``infos``."""
    thinkings: dict[int, Thinking] = {}
    for i, t in enumerate(group.trajectories):
        if not t.completion_ids:
            infos[i] = RevisionInfo(trajectory_id=t.id, status="no_tokens")
            continue
        th = chunk_thinking(
            t.completion_ids,
            decode,
            min_tokens=params.min_chunk_tokens,
            max_tokens=params.max_chunk_tokens,
            think_open=markers.think_open,
            think_close=markers.think_close,
        )
        if th.n_tokens == 0 or not th.chunks:
            infos[i] = RevisionInfo(trajectory_id=t.id, status="no_think")
            continue
        thinkings[i] = th
    return thinkings


def _plans(
    group: Group,
    params: ReflectParams,
    thinkings: dict[int, Thinking],
    detections: dict[int, Detection],
    infos: dict[int, RevisionInfo],
) -> list[_Plan]:
    """The cuts to complete: each detection's cut, limited by ``max_removed_fraction``; a trajectory
    left as it is gets its status in ``infos``."""
    plans: list[_Plan] = []
    for i, th in thinkings.items():
        t, det = group.trajectories[i], detections[i]
        info = RevisionInfo(
            trajectory_id=t.id, status="truncated", think_tokens=th.n_tokens, n_chunks=len(th.chunks)
        )
        infos[i] = info
        if det.cut is None:
            info.status, info.detail = det.status, det.detail  # type: ignore[assignment]
            continue
        cut = limit_cut(th, det.cut, params.max_removed_fraction)
        info.cut = cut
        info.chunk = det.chunk if cut == det.cut else _chunk_ending_at(th, cut)
        if cut >= th.end:
            info.status, info.detail = "nothing_to_remove", "the cut keeps every thinking token"
            continue
        info.removed_tokens = th.end - cut
        plans.append(_Plan(i, t, th, cut, det))
    return plans


def _chunk_ending_at(th: Thinking, cut: int) -> int | None:
    for k, c in enumerate(th.chunks):
        if c.end == cut:
            return k
    return None


def _detect(
    group: Group,
    params: ReflectParams,
    label: Labeler | None,
    thinkings: dict[int, Thinking],
    decode: Callable[[list[int]], str],
    verdicts: list[bool],
) -> dict[int, Detection]:
    out: dict[int, Detection] = {}
    if params.detector == "gold":
        n = sum(len(th.chunks) for th in thinkings.values())
        if len(verdicts) != n:
            raise InputError(["verdicts"], f"{len(verdicts)} verdicts for {n} chunks")
        k = 0
        for i, th in thinkings.items():
            out[i] = detect_gold(th, verdicts[k : k + len(th.chunks)])
            k += len(th.chunks)
        return out
    for i, th in thinkings.items():
        if params.detector == "heuristic":
            out[i] = detect_heuristic(th, params.keyword_k, params.keywords, params.keyword_gap_chars)
        elif params.detector == "fixed":
            out[i] = detect_fixed(th, params.fixed_keep)
        else:
            t = group.trajectories[i]
            question = group.prompt or decode(list(t.prompt_ids))
            try:
                if label is None:
                    raise ServiceError(
                        "model_error", "no reflection model configured (LOOM_REFLECT_MODEL_URL)"
                    )
                labels = label(model_prompt(question, th.chunks), len(th.chunks))
            except ServiceError as exc:
                out[i] = Detection(cut=None, status=exc.status, detail=str(exc))
                continue
            out[i] = detect_model(th, labels.text, params.strength, labels.tokens, labels.tops)
    return out


def revision_pairs(group: Group) -> list[tuple[str, str]]:
    """(original id, revision id) for every revision in ``group``."""
    return [
        (t.parent_id, t.id) for t in group.trajectories if t.parent_id is not None and "revision_of" in t.meta
    ]


__all__: Sequence[str] = (
    "Services",
    "InputError",
    "ServiceError",
    "build_revision",
    "check_input",
    "is_correct",
    "keep_revision",
    "limit_cut",
    "revise_group",
    "revision_pairs",
    "unique_revision_id",
)
