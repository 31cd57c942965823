"""Wire contracts: the only types that cross a process boundary (HTTP bodies and queue messages).

Rules that keep them growable:
- every new field has a default, so old producers stay valid (growth is additive);
- requests forbid unknown fields, so a misspelled parameter is a 422 naming it, not a silent default;
- token ids are the truth, text is derived; every per-token list is aligned to ``completion_ids``.
``SCHEMA_VERSION`` is exposed on ``/version`` and in the OpenAPI document of every service.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from loom.contracts.estimators import ESTIMATOR_PARAMS, EstimatorParams, params_union, tagged_params
from loom.contracts.modes import MAX_TOKENS, MODE_PARAMS, SAMPLING_DEFAULTS

SCHEMA_VERSION = "1.0"
# the highest sampling temperature: vLLM 0.32 refuses more (400), so every engine is held to it
MAX_TEMPERATURE = 2.0
# steps per attention-scoring call (loom.fci): the scorer keeps a steps x steps matrix per layer and head
MAX_ATTENTION_STEPS = 4096

if TYPE_CHECKING:
    Mode = str
    Estimator = str
    EstimatorParamsUnion = EstimatorParams
else:  # the names are the tables' keys: a mode or an estimator is registered once, in its table
    Mode = Literal[tuple(MODE_PARAMS)]
    Estimator = Literal[tuple(ESTIMATOR_PARAMS)]
    # an estimator's params: the discriminated union of the table's models, keyed by its name
    EstimatorParamsUnion = params_union()
SegmentKind = Literal[
    "prompt", "observation", "stream", "deep", "answer", "thread", "revision", "tree_node", "turn"
]
FinishReason = Literal["stop", "length", "abort", "error"]
RewardStatus = Literal[
    "ok",
    "timeout",
    "parse_error",
    "no_answer",
    "invalid",
    "sandbox_error",
    "judge_timeout",
    "judge_unparsable",
    "judge_unavailable",
    "prm_timeout",
    "prm_unparsable",
    "prm_unavailable",
]


Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
TaskKind = Literal["math", "choice", "countdown", "arithmetic", "code"]


def _finite_numbers(value: Any, path: str = "") -> Any:
    """Refuse NaN and infinity anywhere inside a free-form parameter dict (typed float fields are
    checked by ``allow_inf_nan``; ``dict[str, Any]`` values are not)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{path or 'value'} must be a finite number, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            _finite_numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _finite_numbers(v, f"{path}[{i}]")
    return value


Params = Annotated[dict[str, Any], AfterValidator(_finite_numbers)]
"""A free-form parameter dict (mode, estimator, component parameters) of finite numbers only."""


def _unencodable(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _has_unencodable(value: Any) -> bool:
    """Whether a string anywhere in ``value`` (a str, or JSON's dicts and lists, keys included)
    cannot be encoded as UTF-8. Iterative: a deeply nested value cannot exhaust the stack."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if _unencodable(v):
                return True
        elif isinstance(v, dict):
            if any(isinstance(k, str) and _unencodable(k) for k in v):
                return True
            todo.extend(v.values())
        elif isinstance(v, list | tuple):
            todo.extend(v)
    return False


def unencodable_path(value: Any) -> str | None:
    """Where in ``value`` a string that cannot be encoded as UTF-8 is (``""``: ``value`` itself;
    ``.key`` and ``[i]`` below it, a key shown with escapes), or None when every one can."""
    if not _has_unencodable(value):
        return None
    todo: list[tuple[Any, str]] = [(value, "")]
    while todo:
        v, path = todo.pop()
        if isinstance(v, str) and _unencodable(v):
            return path
        if isinstance(v, dict):
            for k, x in reversed(v.items()):
                key = k.encode("utf-8", "backslashreplace").decode() if isinstance(k, str) else str(k)
                if isinstance(k, str) and _unencodable(k):
                    return f"{path}.{key}"
                todo.append((x, f"{path}.{key}"))
        elif isinstance(v, list | tuple):
            todo.extend((x, f"{path}[{i}]") for i, x in reversed(list(enumerate(v))))
    return None  # not reached: _has_unencodable found one


def _holds_text(annotation: Any) -> bool:
    """Whether a field of this type may hold a string that no nested model checks itself."""
    if annotation is str or annotation is Any or annotation is object:
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return False
    if get_origin(annotation) is Literal:  # only the listed values pass
        return False
    return any(_holds_text(a) for a in get_args(annotation))


@cache
def _text_fields(model: type[BaseModel]) -> tuple[str, ...]:
    return tuple(name for name, f in model.model_fields.items() if _holds_text(f.annotation))


class EncodableText(BaseModel):
    """A model whose strings can all be encoded as UTF-8, in every field, nested dicts and lists (keys
    included) too: a 422 naming the field otherwise. JSON's ``\\ud800`` escape decodes to a lone
    surrogate, which pydantic passes in an unconstrained ``str`` field and in ``Any``; accepted, it
    made every later answer that carried it a 500."""

    @model_validator(mode="after")
    def _encodable_text(self) -> Any:
        # one check a model (its text fields only); nested models check their own fields
        for name in _text_fields(type(self)):
            value = getattr(self, name)
            where = None if value is None else unencodable_path(value)
            if where is not None:
                error = PydanticCustomError(
                    "string_unicode",
                    "a string{where} holds a lone surrogate (a \\ud800-\\udfff escape), which UTF-8 "
                    "cannot encode: text must be valid Unicode",
                    {"where": f" at {where.lstrip('.')[:200]}" if where else ""},
                )
                details = [InitErrorDetails(type=error, loc=(name,), input=value)]
                raise ValidationError.from_exception_data(type(self).__name__, details)
        return self


class Contract(EncodableText):
    """Base of every wire type: unknown fields are an error (422 with the field path), and so is a
    NaN or infinite number in any float field (a NaN reward or log-prob would otherwise reach the
    learner and turn the policy's weights into NaN) and a string UTF-8 cannot encode
    (``EncodableText``)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


# --------------------------------------------------------------------------------------------------
# Generation


class SamplingParams(Contract):
    n: int = Field(default=SAMPLING_DEFAULTS.n, ge=1, le=1024)
    max_tokens: int = Field(default=SAMPLING_DEFAULTS.max_tokens, ge=1, le=MAX_TOKENS)
    temperature: float = Field(
        default=1.0, ge=0.0, le=MAX_TEMPERATURE, description="at most 2, as vLLM accepts (a 400 there)"
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1, description="a 64-bit integer")
    stop: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(
        default_factory=list, max_length=64
    )
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    stop_token_sequences: list[Annotated[list[int], Field(min_length=1, max_length=64)]] = Field(
        default_factory=list,
        max_length=16,
        description="stop when the generated ids end with one of these (a marker that is several tokens;"
        " engines with the 'stop_sequences' capability)",
    )
    logprobs: int = Field(default=0, ge=0, le=20, description="top-k log-probs per token (0 = sampled only)")
    # vLLM's logits processors, applied in vLLM's order (docs/interop-engine.md): the neutral defaults
    # leave sampling exactly as without them
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="drop tokens below min_p * max prob")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=100.0, description="on prompt and output tokens (1 = none)"
    )
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="on output tokens")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="per occurrence in the output")
    min_tokens: int = Field(default=0, ge=0, description="no EOS, stop id or stop string before this many")
    ignore_eos: bool = False
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] = Field(
        default_factory=dict, max_length=1024, description="token id -> value added to its logit"
    )
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, min_length=1, description="sample only these tokens (None = all)"
    )


class LogprobsProcessing(Contract):
    """The sampling transforms behind 'processed' behaviour log-probs (vLLM's processed_logprobs):
    log-softmax of the logits divided by ``temperature`` after top-k and top-p masking."""

    temperature: float = Field(ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)


class Segment(Contract):
    """A typed span of a trajectory's completion, in completion-token offsets [start, end)."""

    kind: SegmentKind
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    index: int = Field(default=0, description="e.g. the sentence number t of a stream segment")
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ordered(self) -> Segment:
        if self.end < self.start:
            raise ValueError("segment end must be >= start")
        return self


class Trajectory(Contract):
    id: str = Field(min_length=1, max_length=200)
    group_id: str = Field(min_length=1, max_length=200)
    prompt_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    completion_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    logprobs: list[float] | None = Field(
        default=None, description="behaviour log-prob of each completion token"
    )
    logprobs_kind: Literal["raw", "processed"] = "raw"
    logprobs_processing: LogprobsProcessing | None = Field(
        default=None,
        description="for 'processed' log-probs: the temperature, top-p and top-k applied to them "
        "(None: unknown, and the learner does not use them)",
    )
    loss_mask: list[int] | None = Field(default=None, description="1 = trained; None = all tokens trained")
    segments: list[Segment] = Field(default_factory=list)
    finish_reason: FinishReason = "stop"
    stop_reason: str | int | None = None
    policy_version: int = Field(default=0, ge=0)
    policy_namespace: str | None = Field(
        default=None, description="the namespace of policy_version (None: Loom's learner store)"
    )
    engine: str = ""
    timing: dict[str, float] = Field(default_factory=dict)
    parent_id: str | None = Field(default=None, description="tree parent / spawning call / revised original")
    text: str | None = Field(default=None, description="decoded completion, for convenience only")
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _aligned(self) -> Trajectory:
        n = len(self.completion_ids)
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ValueError(f"logprobs has {len(self.logprobs)} entries for {n} completion tokens")
        if self.loss_mask is not None:
            if len(self.loss_mask) != n:
                raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {n} completion tokens")
            if any(m not in (0, 1) for m in self.loss_mask):
                raise ValueError("loss_mask entries must be 0 or 1")
        for seg in self.segments:
            if seg.end > n:
                raise ValueError(f"segment {seg.kind}[{seg.start}:{seg.end}] exceeds {n} completion tokens")
        return self


class TreeNode(Contract):
    id: str
    parent: str | None = None
    trajectory_id: str
    start: int = Field(ge=0, description="completion-token offset where this node's tokens begin")
    end: int = Field(ge=0)


class ThreadLink(Contract):
    """A spawn/join edge: ``child`` was spawned by ``parent`` (APR)."""

    parent: str
    child: str
    message: str = ""


class PoolStats(Contract):
    """Adaptive sampling (Reinforce-Ada): statistics of every response sampled for the prompt."""

    n_sampled: int = Field(ge=0)
    reward_sum: float = 0.0
    reward_sq_sum: float = 0.0
    n_positive: int = Field(default=0, ge=0)
    rounds: int = Field(default=1, ge=0)


class Group(Contract):
    """One prompt's samples: Loom's unit of scheduling, scoring and advantage computation."""

    id: str = Field(min_length=1, max_length=200)
    mode: Mode = "plain"
    prompt: str | None = None
    label: str | None = Field(default=None, description="gold answer / dataset label")
    task: TaskKind | None = None
    trajectories: list[Trajectory] = Field(default_factory=list)
    tree: list[TreeNode] | None = None
    threads: list[ThreadLink] | None = None
    pool: PoolStats | None = None
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _members(self) -> Group:
        for t in self.trajectories:
            if t.group_id != self.id:
                raise ValueError(f"trajectory {t.id} has group_id {t.group_id}, expected {self.id}")
        return self


MAX_VERSION = 2**53  # policy versions and step numbers: exact in JSON and in SQLite's 64-bit integers


class PolicyAt(Contract):
    """The policy a request's groups are generated with: the fields a rollout request, a job and a
    run's requests share (docs/interop-rollout.md), and their one rule."""

    policy_version: int | None = Field(
        default=None,
        ge=0,
        le=MAX_VERSION,
        description="generate with this policy version or a newer one; an engine holding an older "
        "version loads it from the policy store first (how every replica catches up); None: the "
        "deployment's base model (version 0), never whatever the engine holds",
    )
    policy_namespace: str | None = Field(
        default=None,
        max_length=64,
        description="the namespace policy_version is numbered in (a trainer's published versions, "
        "docs/interop-rollout.md; through the gateway the key's own, or one of its runs' lineages, "
        "run-<id>); None: Loom's learner store",
    )
    policy_match: Literal["at_least", "exact"] = Field(
        default="at_least", description="'exact': that version and no newer one"
    )

    @model_validator(mode="after")
    def _version_for_policy(self) -> PolicyAt:
        if self.policy_version is None and (
            self.policy_namespace is not None or self.policy_match == "exact"
        ):
            raise ValueError("policy_namespace and policy_match 'exact' need a policy_version")
        return self


class RolloutRequest(PolicyAt):
    group_id: str | None = None
    mode: Mode = "plain"
    prompt: str | None = Field(default=None, max_length=1_000_000)
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    label: str | None = None
    task: TaskKind | None = None
    mode_params: Params = Field(default_factory=dict)
    mode_params_resolved: bool = Field(
        default=False,
        description="mode_params is the gateway's resolved form (loom.contracts.modes.resolved_form: "
        "every field, checked and defaults filled at submission), which the rollout worker takes "
        "without parsing again; the public /v1/rollouts parses whatever it is sent",
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> RolloutRequest:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of prompt or prompt_ids")
        return self


# --------------------------------------------------------------------------------------------------
# Rewards


class RewardComponent(Contract):
    name: str = Field(min_length=1, max_length=64)
    weight: float = Field(default=1.0, ge=-1e6, le=1e6)
    params: Params = Field(default_factory=dict)


class RewardSpec(Contract):
    components: list[RewardComponent] = Field(
        default_factory=lambda: [RewardComponent(name="accuracy")], min_length=1, max_length=32
    )
    timeout_s: int = Field(default=5, ge=1, le=300, description="hard per-item verification deadline")


class StepScore(Contract):
    """One step's score from a process reward (docs/interop-reward.md "Process rewards"): the step's
    span [start, end) in completion-token offsets (``unit`` "char": character offsets in the text, for
    a trajectory sent without its token ids) and the PRM's P(yes) for the prefix ending with it."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    score: float
    unit: Literal["token", "char"] = "token"


class TrajectoryReward(Contract):
    trajectory_id: str
    total: float
    components: dict[str, float] = Field(default_factory=dict)
    status: RewardStatus = "ok"
    detail: str | None = None
    steps: dict[str, list[StepScore]] | None = Field(
        default=None, description="per-step scores by component (process rewards); None: no step scores"
    )


class RewardResult(Contract):
    group_id: str
    rewards: list[TrajectoryReward]
    score_s: float | None = Field(
        default=None,
        description="seconds the reward core spent on this group's request (plan + verification + "
        "composition), measured where it ran: the caller's wall time minus this is transport",
    )


class RewardRequest(Contract):
    groups: list[Group] = Field(min_length=1, max_length=4096)
    spec: RewardSpec = Field(default_factory=RewardSpec)


# --------------------------------------------------------------------------------------------------
# Learning


TisLevel = Literal["off", "token", "sequence"]


class LossSpec(Contract):
    eps_low: float = Field(default=0.2, ge=0.0)
    eps_high: float = Field(default=0.28, ge=0.0)
    kl_coef: float = Field(default=0.0, ge=0.0)
    entropy_coef: float = Field(default=0.0, ge=-1.0, le=1.0)
    aggregation: Aggregation = "token_mean"
    hrpo_lambda: float = Field(default=0.05, ge=0.0)
    lr: float = Field(default=1e-4, gt=0.0, le=1.0)
    warmup_steps: int = Field(
        default=0,
        ge=0,
        description="linear lr warmup over the first optimizer steps; Adam's first steps move every "
        "weight by about lr whatever the gradient's size, which a small policy does not survive",
    )
    max_grad_norm: float = Field(default=1.0, gt=0.0, le=1e6)
    temperature: float = Field(
        default=1.0,
        gt=0.0,
        le=MAX_TEMPERATURE,
        description="divide the logits by this when recomputing log-probs: set it to the rollout's "
        "sampling temperature to train the policy that was sampled (verl's convention). Behaviour "
        "log-probs are used for the ratio only when they are what the learner computes: 'raw' ones "
        "at temperature 1, or 'processed' ones of this temperature with no top-p/top-k (the learner "
        "applies neither); otherwise the ratio is taken against the current policy (metrics "
        "behaviour_logprobs_used / behaviour_logprobs_unmatched)",
    )
    updates_per_batch: int = Field(
        default=1,
        ge=1,
        le=16,
        description="optimizer steps on each batch (PPO's mu): every pass recomputes the log-probs, "
        "the clipped ratio is taken against the behaviour log-probs (for rows without usable ones, "
        "against the first pass's), and warmup counts per batch",
    )
    tis: TisLevel = Field(
        default="off",
        description="truncated importance sampling for the rollout-train mismatch (docs/algorithms.md "
        "§5.2): the ratio is taken against the learner's own old log-probs and each token's surrogate "
        "is weighted by min(pi_old / pi_behaviour, tis_cap), per token ('token') or per sequence "
        "('sequence', the product over its tokens); rows without usable behaviour log-probs get 1",
    )
    tis_cap: float = Field(default=2.0, gt=0.0, le=1e4, description="C, the TIS truncation cap")


class Lineage(Contract):
    """The policy lineage a run trains (docs/security.md "Runs' lineages"): its own namespace, and the
    version it starts from. The run's versions continue its base's numbering in the run's namespace:
    ``base_version`` is the base itself, every later version the run's own (``at``)."""

    namespace: str = Field(
        pattern=r"^run-[A-Za-z0-9_.-]{1,60}$",
        description="the run's namespace (its id: loom.contracts.policies.run_namespace); a key's name "
        "never starts with 'run-', so no key publishes into a run's lineage",
    )
    base_namespace: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="the namespace of the base: None, the deployment's (version 0: its base model); "
        "else the run's key's own published versions",
    )
    base_version: int = Field(default=0, ge=0, le=2**31)

    def at(self, version: int) -> tuple[str | None, int]:
        """(namespace, version) of the lineage's ``version``: the base at ``base_version``, the run's
        own namespace above it."""
        if version < self.base_version:
            raise ValueError(f"version {version} is below the lineage's base {self.base_version}")
        return (self.base_namespace, version) if version == self.base_version else (self.namespace, version)


class TrainBatch(Contract):
    step: int = Field(ge=0)
    lineage: Lineage | None = Field(
        default=None,
        description="the run this batch trains: the learner trains (and detects a redelivery) per "
        "lineage; None: the learner's own namespace (benches, direct callers of /v1/train_step)",
    )
    groups: list[Group] = Field(min_length=1)
    rewards: list[RewardResult] = Field(min_length=1)
    estimator: Estimator = "grpo"
    estimator_params: EstimatorParamsUnion = Field(
        default=None, validate_default=True, description="the estimator's params (its model's fields)"
    )
    loss: LossSpec = Field(default_factory=LossSpec)

    _tag_params = field_validator("estimator_params", mode="before")(tagged_params)

    @field_validator("groups")
    @classmethod
    def _unique_ids(cls, groups: list[Group]) -> list[Group]:
        """A reward is matched to its trajectory by (group id, trajectory id): either repeated would
        give one trajectory another's reward."""
        seen_groups: set[str] = set()
        for g in groups:
            if g.id in seen_groups:
                raise ValueError(f"group id {g.id!r} appears more than once in the batch")
            seen_groups.add(g.id)
            seen: set[str] = set()
            for t in g.trajectories:
                if t.id in seen:
                    raise ValueError(f"trajectory id {t.id!r} appears more than once in group {g.id!r}")
                seen.add(t.id)
        return groups

    @field_validator("rewards")
    @classmethod
    def _one_reward_each(cls, rewards: list[RewardResult]) -> list[RewardResult]:
        seen: set[tuple[str, str]] = set()
        for res in rewards:
            for r in res.rewards:
                key = (res.group_id, r.trajectory_id)
                if key in seen:
                    raise ValueError(
                        f"trajectory {r.trajectory_id!r} of group {res.group_id!r} has more than one reward"
                    )
                seen.add(key)
        return rewards


class StepResult(Contract):
    step: int
    policy_version: int
    metrics: dict[str, float] = Field(default_factory=dict)
    n_tokens: int = 0
    policy: PolicyVersion | None = Field(default=None, description="the version now current (to announce)")


class PolicyVersion(Contract):
    version: int = Field(ge=0)
    path: str
    namespace: str | None = Field(default=None, description="None: Loom's learner store")
    kind: Literal["full", "lora"] = "full"
    created_at: float = 0.0
    meta: dict[str, Any] = Field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Reflection truncation (reflect_svc, docs/algorithms.md §3)

ReflectDetector = Literal["gold", "model", "heuristic", "fixed"]
ReflectStrength = Literal["weak", "normal", "strong"]
# truncated: a revision was generated; the others say why a trajectory was left as it is.
ReflectStatus = Literal[
    "truncated",
    "no_think",  # no thinking part (or an empty one)
    "no_detection",  # the detector found no chunk with the answer
    "nothing_to_remove",  # the cut (after the half limit) removes no thinking token
    "malformed_output",  # the reflection model's labels were unusable (wrong count, garbage)
    "model_error",  # the reflection model could not be reached / answered an error
    "verifier_error",  # the reward service could not check the chunks
    "no_tokens",  # the trajectory carries no completion token ids
]


class ReflectParams(Contract):
    detector: ReflectDetector = "gold"
    strength: ReflectStrength = Field(default="normal", description="model detector: weak/normal/strong")
    keyword_k: int = Field(default=1, ge=1, description="heuristic: cut before the k-th reflection")
    keywords: list[Annotated[str, Field(min_length=1, max_length=100, pattern=r"\S")]] = Field(
        default_factory=lambda: ["wait", "alternatively", "check", "but"],
        min_length=1,
        max_length=64,
        description="a blank keyword would match at every word boundary: refused",
    )
    keyword_gap_chars: int = Field(default=59, ge=0, description="keywords this close count once")
    fixed_keep: float = Field(default=0.7, gt=0.0, le=1.0, description="fixed: fraction of thinking kept")
    min_chunk_tokens: int = Field(default=32, ge=1, le=100_000)
    max_chunk_tokens: int = Field(default=128, ge=1, le=100_000)
    max_removed_fraction: float = Field(default=0.5, ge=0.0, le=0.5, description="of the thinking tokens")
    forced_ending: str = Field(default="\n</think>\n\n**Final Answer:**\n\n", max_length=1000)
    max_tokens: int = Field(default=256, ge=1, le=MAX_TOKENS, description="budget of the policy's completion")
    temperature: float = Field(default=1.0, ge=0.0, le=MAX_TEMPERATURE)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    reward: RewardSpec = Field(default_factory=RewardSpec, description="scores originals and revisions")
    keep_discarded: bool = Field(default=False, description="return discarded revisions too (for analysis)")

    @field_validator("max_chunk_tokens")
    @classmethod
    def _chunk_bounds(cls, v: int, info: ValidationInfo) -> int:
        lo = info.data.get("min_chunk_tokens")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= min_chunk_tokens ({lo})")
        return v


class ReflectRequest(Contract):
    group: Group
    params: ReflectParams = Field(default_factory=ReflectParams)


class RevisionInfo(Contract):
    """What reflection did to one original trajectory."""

    trajectory_id: str
    status: ReflectStatus
    detail: str | None = None
    revision_id: str | None = None
    kept: bool = False
    discard_reason: Literal["original_correct_revision_wrong", "both_wrong"] | None = None
    think_tokens: int = 0
    removed_tokens: int = 0  # thinking tokens removed by the cut
    cut: int | None = Field(default=None, description="completion-token offset where the prefix ends")
    chunk: int | None = Field(default=None, description="index of the last kept chunk")
    n_chunks: int = 0
    original_correct: bool | None = None
    revision_correct: bool | None = None


class ReflectResult(Contract):
    group: Group  # the input group with the kept revisions placed after their originals
    revisions: list[RevisionInfo] = Field(default_factory=list)


class RevisionCut(Contract):
    """One planned revision: trajectory ``index`` of the group keeps its completion up to ``cut``,
    then ``forced_ids`` (the forced ending's tokens), then what the policy completes."""

    index: int = Field(ge=0)
    cut: int = Field(ge=0)
    forced_ids: list[int] = Field(default_factory=list)
    revision_id: str = Field(min_length=1, max_length=200)
    meta: dict[str, Any] = Field(default_factory=dict)


class RevisionPlan(Contract):
    """What the reflect service decided for one group (docs/algorithms.md §3), before any revision is
    generated or scored: the gateway's RL step generates ``requests`` (one per cut, in order) and
    scores the revised group itself, with the run's reward spec. ``match_texts``: the gold detector's
    chunk texts, to be checked against the gold answer (``reward.match_texts``) and handed back as
    verdicts before a plan with cuts can be made."""

    match_texts: list[str] = Field(default_factory=list)
    requests: list[RolloutRequest] = Field(default_factory=list)
    cuts: list[RevisionCut] = Field(default_factory=list)
    revisions: list[RevisionInfo] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_request_per_cut(self) -> RevisionPlan:
        if len(self.requests) != len(self.cuts):
            raise ValueError(f"{len(self.requests)} requests for {len(self.cuts)} cuts")
        return self


# --------------------------------------------------------------------------------------------------
# Service plumbing


class VersionInfo(Contract):
    service: str
    version: str
    schema_version: str = SCHEMA_VERSION
