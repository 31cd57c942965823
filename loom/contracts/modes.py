"""The rollout modes' parameters: one typed model per mode, each default written once, and the one
table of mode names (docs/algorithms.md §2). Pure: pydantic and ``loom`` only, so the gateway
validates a submission's ``mode_params`` exactly as the rollout service will parse them, without
importing the service.

``parse_mode_params(request, limits)`` is the one parse, at the edge a request enters (the gateway at
submission, the rollout service for a direct ``/v1/rollouts``): unknown keys are refused, ints must be ints,
floats accept ints, bools are strict, ``null`` means the default, and a bad value is a ``ModeError``
whose message names the parameter. ``ModeLimits`` carries the deployment's bounds and defaults
(``ModeSettings``: ``LOOM_ROLLOUT_SEGMENT_CAP``, ``LOOM_ROLLOUT_READING_WPM``; and
``LOOM_ATTENTION_TIMEOUT_S``); the request's own sampling gives the defaults that follow it (tree
``initial``, streaming ``deep_max_tokens``). What the gateway parsed travels as ``resolved_form``
(every field, defaults and limits filled in) and ``mode_params_of`` rebuilds the model from it
without a second parse (docs/architecture.md, "Contracts").
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from loom.contracts.settings import Settings, get_settings

if TYPE_CHECKING:
    from loom.contracts.wire import RolloutRequest, SamplingParams
from loom.formats import DEFAULT_MARKERS, DEFAULT_SPAWN, SpawnSyntax

# ``loom.contracts.wire.SamplingParams``' bound on ``max_tokens`` and the defaults a mode's request
# defaults follow: written here, since this module imports no wire model (the wire's ``Mode`` derives
# from its table).
MAX_TOKENS = 131072


@dataclass(frozen=True)
class SamplingDefaults:
    """``SamplingParams``' defaults of the fields a mode's defaults read (``n``, ``max_tokens``)."""

    n: int = 1
    max_tokens: int = 256


SAMPLING_DEFAULTS = SamplingDefaults()
MAX_SENTENCES = 1024
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


class ModeError(ValueError):
    """The request asks a mode for something it cannot do; the message names the limit."""

    kind = "mode_error"


class ModeSettings(BaseSettings):
    """The rollout modes' deployment bounds (``LOOM_ROLLOUT_*``; ``rollout_svc.config.RolloutSettings``
    extends them): in the contracts because the gateway resolves a submission's mode params against
    them too."""

    model_config = SettingsConfigDict(env_prefix="LOOM_ROLLOUT_", extra="ignore", frozen=True)

    reading_wpm: float = Field(default=150.0, gt=0, description="streaming: words per minute")
    segment_cap: int = Field(default=512, ge=1, description="streaming: max tokens per thought")


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].default


@dataclass(frozen=True)
class ModeLimits:
    """The deployment's bounds on mode parameters (the defaults are ModeSettings' and Settings')."""

    segment_cap: int = _default(ModeSettings, "segment_cap")  # LOOM_ROLLOUT_SEGMENT_CAP
    reading_wpm: float = _default(ModeSettings, "reading_wpm")  # LOOM_ROLLOUT_READING_WPM
    max_attention_timeout_s: float = _default(Settings, "attention_timeout_s")  # LOOM_ATTENTION_TIMEOUT_S

    @classmethod
    def from_settings(cls, settings: Settings, modes: ModeSettings | None = None) -> ModeLimits:
        """``modes`` None: read from the environment (``LOOM_ROLLOUT_*``)."""
        m = modes or ModeSettings()
        return cls(m.segment_cap, m.reading_wpm, settings.attention_timeout_s)


@dataclass(frozen=True)
class _Context:
    """What a model's request-dependent defaults read (``model_validate(..., context=...)``)."""

    limits: ModeLimits
    sampling: SamplingParams | SamplingDefaults


def _context(info: ValidationInfo) -> _Context:
    ctx = info.context
    return ctx if isinstance(ctx, _Context) else _Context(ModeLimits(), SAMPLING_DEFAULTS)


class ModeParams(BaseModel):
    """Base of the per-mode models: strict types, no unknown keys; ``null`` stands for the default
    (except for the keys in ``NULL_REFUSED``, whose model says what their null means)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    NULL_REFUSED: ClassVar[frozenset[str]] = frozenset()
    REFUSED: ClassVar[dict[str, str]] = {}  # keys refused with a reason of their own
    # how the built-in tasks are posed in this mode (gateway/datasets.py, ``loom demo``): the tiny
    # model's prompt format (``zoo.tiny.traces.FORMATS``), the built-in model trained for the mode
    # (zoo/registry.py), and the reward components that check the format (logged beside accuracy)
    BUILTIN_FORMAT: ClassVar[str] = "plain"
    BUILTIN_MODEL: ClassVar[str] = "tiny"
    FORMAT_REWARDS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _with_defaults(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        given = {k: v for k, v in data.items() if v is not None or k in cls.NULL_REFUSED}
        return cls.prepare(cls.request_defaults(_context(info)) | given)

    @classmethod
    def request_defaults(cls, ctx: _Context) -> dict[str, Any]:
        """The defaults that follow the request or the deployment (the others are the fields')."""
        return {}

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        """The given keys, defaults filled, before the fields are validated."""
        return data


class PlainParams(ModeParams):
    """plain (docs/algorithms.md §2.1): n samples of one prompt; no parameters."""


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE.split(text.strip()) if s.strip()]


class StreamingParams(ModeParams):
    """streaming (docs/algorithms.md §2.2; AdaSR, StreamingThinker). ``sentences`` (a list) or
    ``context`` (text, split after ``.``, ``!``, ``?``) is required; ``sentences`` wins when both are
    given. Defaults from the request: ``segment_cap`` and ``reading_wpm`` the deployment's,
    ``deep_max_tokens`` the request's ``sampling.max_tokens``."""

    NULL_REFUSED: ClassVar[frozenset[str]] = frozenset(
        {"sentences", "context"}
    )  # sentences: refused; context: ""
    BUILTIN_FORMAT: ClassVar[str] = "stream"
    FORMAT_REWARDS: ClassVar[tuple[str, ...]] = ("format_stream", "format_deep")

    sentences: list[str]
    context: str | None = None
    layout: Literal["interleaved", "group_positions"] = "interleaved"
    segment_cap: int = Field(ge=1, le=8192)
    deep_max_tokens: int = Field(ge=1, le=MAX_TOKENS)
    answer_max_tokens: int = Field(64, ge=1, le=MAX_TOKENS)
    reading_wpm: float = Field(gt=0, allow_inf_nan=False)  # sentence arrival times divide by it
    sentence_prefix: str = " "
    connector: str = " " + DEFAULT_MARKERS.connector

    @classmethod
    def request_defaults(cls, ctx: _Context) -> dict[str, Any]:
        limits = ctx.limits
        return {
            "segment_cap": limits.segment_cap,
            "reading_wpm": limits.reading_wpm,
            "deep_max_tokens": ctx.sampling.max_tokens,
        }

    @classmethod
    def prepare(cls, data: dict[str, Any]) -> dict[str, Any]:
        if "sentences" in data:
            return data
        if "context" not in data:
            raise ValueError("streaming needs mode_params.sentences (list) or mode_params.context (text)")
        text = "" if data["context"] is None else data["context"]
        if not isinstance(text, str):
            raise ValueError(f"mode_params.context must be str, got {type(text).__name__}")
        return data | {"sentences": split_sentences(text)}

    @model_validator(mode="after")
    def _sentence_count(self) -> StreamingParams:
        if not self.sentences:
            raise ValueError("streaming needs at least one sentence")
        if len(self.sentences) > MAX_SENTENCES:
            raise ValueError(f"streaming takes at most {MAX_SENTENCES} sentences")
        return self


class _Branching(ModeParams):
    """What the two branching modes (tree, agent_tree) default and bound alike: ``initial`` is
    ``sampling.n`` when n > 1, else 6; ``attention_timeout_s`` is the deployment's bound
    (``LOOM_ATTENTION_TIMEOUT_S``), which a request may only shorten; the attention scorer's URL is
    the operator's, never a request's."""

    REFUSED: ClassVar[dict[str, str]] = {
        "attention_url": "mode_params.attention_url is not accepted: a worker never calls a URL from a "
        "request; the attention scorer is the operator's setting LOOM_ATTENTION_URL"
    }

    attention_timeout_s: float

    @classmethod
    def request_defaults(cls, ctx: _Context) -> dict[str, Any]:
        n = ctx.sampling.n
        return {"initial": n if n > 1 else 6, "attention_timeout_s": ctx.limits.max_attention_timeout_s}

    @model_validator(mode="after")
    def _timeout_bound(self, info: ValidationInfo) -> Self:
        attention_timeout_bound(self.attention_timeout_s, info)
        return self


class TreeParams(_Branching):
    """tree (docs/algorithms.md §2.3; TreeRL, AttnRL). Defaults from the request as ``_Branching``
    says: ``initial`` (M') and ``attention_timeout_s``."""

    NULL_REFUSED: ClassVar[frozenset[str]] = frozenset({"entropy_stop_words"})

    initial: int = Field(ge=1, le=256)  # M'
    branches: int = Field(2, ge=0, le=64)  # N
    continuations: int = Field(2, ge=1, le=64)  # T
    iterations: int = Field(1, ge=1, le=8)  # L: expansion rounds (TreeRL's EPTree)
    strategy: Literal["attention", "entropy", "random"] = "attention"
    delta: int = Field(4, ge=1, le=MAX_TOKENS)
    quantile: float = Field(0.8, ge=0.0, le=1.0)
    min_distance: int = Field(512, ge=0, le=MAX_TOKENS)
    separator: str = Field("\n\n", min_length=1)
    fallback_separator: str = Field("\n", min_length=1)
    end_marker: str = "</think>"
    entropy_stop_words: list[str] = Field(default_factory=lambda: ["answer", "conclusion"])
    expansion: Literal["round", "ceil", "all"] = "round"
    fci_running_mean: float | None = None
    train_prefix: bool = True  # a branch's copied prefix is trained (TreeRL trains every leaf path)


def attention_timeout_bound(value: float, info: ValidationInfo) -> None:
    """A request's ``attention_timeout_s`` may only shorten the deployment's bound."""
    bound = _context(info).limits.max_attention_timeout_s
    if not 0.0 < value <= bound:
        raise ValueError(
            f"mode_params.attention_timeout_s must be > 0 and at most {bound} s "
            "(LOOM_ATTENTION_TIMEOUT_S on this deployment)"
        )


_SYNTAX_KEYS = ("spawn_open", "spawn_child", "spawn_close", "join_open", "join_child", "join_close")


class SpawnParams(ModeParams):
    """spawn (docs/algorithms.md §2.4; APR): the spawn/join syntax (defaults: ``loom.formats.DEFAULT_SPAWN``,
    APR's Countdown syntax), the child prompt template and the limits."""

    BUILTIN_FORMAT: ClassVar[str] = "spawn"

    spawn_open: str = DEFAULT_SPAWN.spawn_open
    spawn_child: str = DEFAULT_SPAWN.spawn_child
    spawn_close: str = DEFAULT_SPAWN.spawn_close
    join_open: str = DEFAULT_SPAWN.join_open
    join_child: str = DEFAULT_SPAWN.join_child
    join_close: str = DEFAULT_SPAWN.join_close
    no_solution: str = DEFAULT_SPAWN.no_solution
    child_template: str = "[child] {message}\n"  # the tiny model's child prompt (zoo.tiny.child_prompt)
    think_close: str = "</think>"
    max_children: int = Field(8, ge=1, le=64)
    max_depth: int = Field(1, ge=0, le=4)  # the parent is depth 0; children at max_depth may not spawn
    child_max_tokens: int = Field(256, ge=1)
    max_total_tokens: int = Field(8192, ge=1)
    max_message_chars: int = Field(512, ge=1, le=100_000)

    @model_validator(mode="after")
    def _templates_and_markers(self) -> SpawnParams:
        check_template("join_child", self.join_child, ("i", "message"))
        check_template("child_template", self.child_template, ("message",))
        blank = sorted(k for k in _SYNTAX_KEYS if not getattr(self, k).strip())
        if blank or not self.think_close.strip():
            raise ValueError(f"spawn markers must not be blank: {blank or ['think_close']}")
        return self

    @property
    def syntax(self) -> SpawnSyntax:
        return SpawnSyntax(
            **{k: getattr(self, k) for k in (*_SYNTAX_KEYS, "no_solution")}, tokens=list(DEFAULT_SPAWN.tokens)
        )


MAX_ENV_OPTIONS_CHARS = 65_536
# the env tier's built-in environments (env_svc/registry.py, docs/environments.md); a deployment's own
# are ``module:factory`` names of a module in ``Settings.env_modules``
ENVIRONMENTS: tuple[str, ...] = ("countdown", "python")


# environment libraries' names, ``<library>:<name>``, each registered by the env workers whose
# interpreter has the library (env_svc/adapters/; docs/environments.md "Environment libraries")
LIBRARIES: tuple[str, ...] = ("verifiers", "skyrl")

# the built-ins an agent_tree may branch by replay (docs/environments.md "Trees by replay"): their
# factories declare ``replayable`` (env_svc/registry.py checks the two agree); a library's never are
REPLAYABLE: tuple[str, ...] = ("countdown", "python")


def replayable_environment(name: str, modules: list[str]) -> bool:
    """Whether an agent_tree may branch episodes of ``name`` by replay: a replayable built-in, or
    ``module:factory`` of a listed module (its factory's ``replayable`` is checked by the env worker
    at each open, which the rollout side cannot import); never a library adapter's."""
    module, _, factory = name.partition(":")
    if name in ENVIRONMENTS or module in LIBRARIES:
        return name in REPLAYABLE
    return bool(factory) and module in modules and known_environment(name, modules)


def known_environment(name: str, modules: list[str]) -> bool:
    """Whether an env worker can open ``name``: a built-in, ``module:factory`` of a listed module, or
    ``<library>:<name>`` of an environment library's adapter."""
    module, _, factory = name.partition(":")
    listed = module in modules or module in LIBRARIES
    return name in ENVIRONMENTS or (bool(factory) and listed and factory.isidentifier())


AGENT_TOOLS = ("calculator", "countdown_check")  # rollout_svc.modes.agent.TOOLS: the built-in registry


class AgentParams(ModeParams):
    """agent (docs/algorithms.md §2.5): multi-turn tool use, token-in/token-out. ``parser`` names the
    tool-call format (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as the
    Qwen2.5/Qwen3 templates write it; ``function``: ``<call>name(argument)</call>``; ``inline``:
    Toolformer's calculator, a turn ending ``7-3=`` calls it and its bare result follows); ``tools`` the
    enabled names of the built-in registry (a request never supplies code or URLs). A turn's budget is
    the request's ``sampling.max_tokens``; ``max_total_tokens`` bounds policy and observation tokens
    together; ``deadline_s`` the episode's wall time, ``tool_timeout_s`` one tool call's."""

    BUILTIN_MODEL: ClassVar[str] = "tool"  # the tiny model fine-tuned to call the calculator

    max_turns: int = Field(8, ge=1, le=64)
    max_total_tokens: int = Field(8192, ge=1, le=MAX_TOKENS)
    parser: Literal["hermes", "function", "inline"] = "hermes"
    tools: list[str] = Field(default_factory=lambda: list(AGENT_TOOLS), min_length=1, max_length=16)
    deadline_s: float = Field(120.0, gt=0, le=3600)
    tool_timeout_s: float = Field(5.0, gt=0, le=60)
    max_observation_tokens: int = Field(256, ge=8, le=8192)
    # the episode's environment on the env tier (docs/environments.md): every turn is its step, the
    # observation its answer, ``tool_timeout_s`` the step's deadline; done ends the episode (env_done)
    environment: str | None = Field(None, min_length=1, max_length=128)
    env_options: dict[str, Any] = Field(default_factory=dict, description="the environment's own options")

    @model_validator(mode="after")
    def _known_tools(self) -> AgentParams:
        unknown = sorted(set(self.tools) - set(AGENT_TOOLS))
        if unknown:
            raise ValueError(f"unknown tools {unknown}; built-in: {list(AGENT_TOOLS)}")
        return self

    @model_validator(mode="after")
    def _known_environment(self) -> AgentParams:
        if self.environment is None:
            if self.env_options:
                raise ValueError("env_options needs an environment")
            return self
        if not known_environment(self.environment, get_settings().env_modules):
            raise ValueError(f"unknown environment {self.environment!r}; built-in: {list(ENVIRONMENTS)}")
        if len(json.dumps(self.env_options, default=str)) > MAX_ENV_OPTIONS_CHARS:
            raise ValueError(f"env_options longer than {MAX_ENV_OPTIONS_CHARS} characters as JSON")
        return self


class AgentTreeParams(_Branching, AgentParams):
    """agent_tree (docs/algorithms.md §2.6; TreeRL's EPTree over agent episodes): the agent's
    parameters, and where its episodes branch. ``initial`` episodes (default ``sampling.n`` when n > 1,
    else 6) are each branched at ``branches`` points per round (``iterations`` rounds) into
    ``continuations`` children that continue from the parent's exact ids: ``strategy`` ``turn``
    branches at the start of a turn that follows an observation, ``entropy`` at the policy tokens with
    the highest -log-prob inside a turn (TreeRL's rule: never the first token, nothing from a
    stop word on), ``attention`` at the earliest high-FCI reasoning steps of the turns (AttnRL: the
    policy's steps split by ``separator``, else ``fallback_separator``; ``delta`` and ``quantile`` as
    tree mode's; the operator's scorer, bounded by ``attention_timeout_s``, as tree mode's). An
    environment's state is not in the ids: a child reopens it and replays its parent's actions, so
    only a replayable ``environment`` is accepted (docs/environments.md)."""

    initial: int = Field(ge=1, le=256)
    branches: int = Field(2, ge=0, le=64)
    continuations: int = Field(2, ge=1, le=64)
    iterations: int = Field(1, ge=1, le=8)
    strategy: Literal["turn", "entropy", "attention"] = "entropy"
    min_distance: int = Field(8, ge=0, le=MAX_TOKENS)
    entropy_stop_words: list[str] = Field(default_factory=lambda: ["answer", "conclusion"])
    delta: int = Field(4, ge=1, le=MAX_TOKENS)
    quantile: float = Field(0.8, ge=0.0, le=1.0)
    separator: str = Field("\n\n", min_length=1)
    fallback_separator: str = Field("\n", min_length=1)
    train_prefix: bool = True

    @model_validator(mode="after")
    def _replayable_environment(self) -> AgentTreeParams:
        name = getattr(self, "environment", None)
        if name is not None and not replayable_environment(name, get_settings().env_modules):
            raise ValueError(
                f"mode_params.environment {name!r} cannot branch: its state is not in the episode's ids "
                "and it is not replayable (a child reopens the environment and replays its parent's "
                f"actions; replayable built-ins: {list(REPLAYABLE)}; or use mode agent)"
            )
        return self


def check_template(name: str, template: str, fields: tuple[str, ...]) -> None:
    """``template`` is filled by ``str.format``: it may hold only bare ``{field}`` placeholders of
    ``fields`` (``{{`` and ``}}`` for literal braces) and must hold ``{message}``; checked here, so a
    bad template is a ModeError at the request, not a crash at the first spawn."""
    allowed = ", ".join(f"{{{f}}}" for f in fields)
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:  # an unmatched brace
        raise ModeError(f"mode_params.{name}: {exc} (write {{{{ and }}}} for literal braces)") from exc
    used = set()
    for _, field_name, spec, conversion in parts:
        if field_name is None:
            continue
        if field_name not in fields or spec or conversion:
            shown = field_name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ModeError(
                f"mode_params.{name} may only use the placeholders {allowed}, got {{{shown}}} "
                "(write {{ and }} for literal braces)"
            )
        used.add(field_name)
    if "message" not in used:
        raise ModeError(f"mode_params.{name} must contain {{message}}")


# The one table of modes: a mode's registration is its line here (its algorithm is the module
# ``rollout_svc/modes/<name>.py``); ``loom.contracts.wire.Mode`` derives from it.
MODE_PARAMS: dict[str, type[ModeParams]] = {
    "plain": PlainParams,
    "streaming": StreamingParams,
    "tree": TreeParams,
    "spawn": SpawnParams,
    "agent": AgentParams,
    "agent_tree": AgentTreeParams,
}


def parse_mode_params(request: RolloutRequest, limits: ModeLimits | None = None) -> ModeParams:
    """``request.mode_params`` as its mode's model (``limits``: the deployment's, default Settings'
    defaults); ``ModeError`` naming the parameter when they are not valid."""
    model = MODE_PARAMS.get(request.mode)
    if model is None:
        raise ModeError(f"unknown mode {request.mode!r}; available: {tuple(MODE_PARAMS)}")
    mp = dict(request.mode_params)
    refused = next((reason for key, reason in model.REFUSED.items() if key in mp), None)
    if refused is not None:
        raise ModeError(refused)
    known = set(model.model_fields)
    unknown = sorted(set(mp) - known)
    if unknown and not known:
        raise ModeError(f"{request.mode} takes no mode_params, got {sorted(mp)}")
    if unknown:
        raise ModeError(f"{request.mode} does not know mode_params {unknown}; known: {sorted(known)}")
    try:
        return model.model_validate(mp, context=_Context(limits or ModeLimits(), request.sampling))
    except ValidationError as exc:
        raise ModeError(_message(model, exc)) from None


def resolved_form(params: ModeParams) -> dict[str, Any]:
    """``params`` as the gateway sends them on: every field, so no hop fills a default of its own."""
    return params.model_dump(mode="json")


def resolved_request(
    request: RolloutRequest, limits: ModeLimits | None = None, sampling: SamplingParams | None = None
) -> RolloutRequest:
    """``request`` with its mode params parsed (``ModeError`` naming a bad one) and carried in their
    resolved form; ``sampling``: the one the worker will generate with when it is not the request's
    own (adaptive rounds), which the request-dependent defaults follow."""
    probe = request if sampling is None else request.model_copy(update={"sampling": sampling})
    form = resolved_form(parse_mode_params(probe, limits))
    return request.model_copy(update={"mode_params": form, "mode_params_resolved": True})


def mode_params_of(request: RolloutRequest, limits: ModeLimits | None = None) -> ModeParams:
    """``request``'s mode params as its mode's model: rebuilt from the gateway's resolved form when
    ``request.mode_params_resolved`` (checked there with the deployment's limits), else parsed
    (``parse_mode_params``). A form that lacks a field (a job stored before resolved forms) is parsed."""
    model = MODE_PARAMS.get(request.mode)
    if (
        request.mode_params_resolved
        and model is not None
        and set(request.mode_params) == set(model.model_fields)
    ):
        return model.model_construct(**request.mode_params)
    return parse_mode_params(request, limits)


def _message(model: type[ModeParams], exc: ValidationError) -> str:
    """The first error of ``exc`` as a sentence naming the parameter."""
    err = exc.errors(include_url=False)[0]
    if not err["loc"]:  # a model validator's own sentence
        return str(err.get("ctx", {}).get("error", err["msg"]))
    name, value, kind = str(err["loc"][0]), err["input"], err["type"]
    field = model.model_fields.get(name)
    if field is not None and field.annotation == list[str]:
        return f"mode_params.{name} must be a list of strings"
    if kind in _TYPES:
        return f"mode_params.{name} must be {_TYPES[kind]}, got {type(value).__name__}"
    if kind == "literal_error":
        return f"mode_params.{name} must be {err['ctx']['expected']}, got {value!r}"
    if kind == "string_too_short":
        return f"mode_params.{name} must be non-empty"
    if field is not None and kind in _BOUND_ERRORS:
        return f"mode_params.{name} must be {_range(field.metadata)}, got {value}"
    return f"mode_params.{name}: {err['msg']}"


_TYPES = {"int_type": "int", "float_type": "float", "string_type": "str", "bool_type": "bool"}
_BOUND_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def _range(metadata: list[Any]) -> str:
    """A field's bounds as words: ``in [1, 64]``, ``>= 0``, ``a finite number > 0``."""
    bounds = {k: getattr(m, k) for m in metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
    finite = any(getattr(m, "allow_inf_nan", None) is False for m in metadata)
    if "ge" in bounds and "le" in bounds:
        words = f"in [{bounds['ge']}, {bounds['le']}]"
    else:
        ops = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        words = " and ".join(f"{ops[k]} {v}" for k, v in bounds.items())
    return f"a finite number {words}" if finite else words
