"""The tree modes' reward callback and attention scorers (tree mode, agent_tree's ``attention``): what
grades an initial response and what scores its steps, apart from the algorithm (rollout_svc.modes.tree,
rollout_svc.modes.agent_tree), which takes both as plain callables.

Reward callback (``RewardFn``): ``(trajectories) -> correctness in [0, 1] per trajectory`` (sync or
async); ``exact_reward_fn`` builds one from loom.exact for arithmetic/countdown requests with a label.

Attention scores come from the engine (``attention_scores`` capability: the torch engine, ``loom
engine``) or, when the operator set ``LOOM_ATTENTION_URL``, from that learner / loom engine's ``POST
/v1/score/attention``; otherwise attention branching is ``UnsupportedCapability``. The scorer is never
a request's: a worker calls no URL taken from a request, so a submitted ``mode_params.attention_url``
is refused (docs/security-workers.md). A scoring call waits at most ``LOOM_ATTENTION_TIMEOUT_S``
(``mode_params.attention_timeout_s`` may only shorten it); a scorer that fails, times out or answers
something other than the scores is a typed error that carries its status, never its reply. Every
scoring call names the policy the engine generates the rollout with (``policy_version`` and
``policy_namespace``, the version the gateway authorised for the request): the scorer scores under
exactly that version or refuses (409 ``attention_version_unavailable``), so a run's tree is never
scored with another lineage's weights (docs/security.md "Runs' lineages").
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from loom.contracts.modes import ModeParams
from loom.contracts.settings import Settings
from loom.contracts.wire import RolloutRequest, Trajectory
from rollout_svc.engines.base import Engine, EngineError, UnsupportedCapability

RewardFn = Callable[[list[Trajectory]], "Sequence[float] | Awaitable[Sequence[float]]"]
Scorer = Callable[[list[int], list[tuple[int, int]], int, "int | None"], Awaitable[list[float]]]
# the operator's scorer: a Scorer for the policy (namespace, version) an engine serves
PolicyScorer = Callable[["tuple[str | None, int]"], Scorer]


def exact_reward_fn(request: RolloutRequest, tokenizer: Any) -> RewardFn | None:
    """Correctness by loom.exact for ``arithmetic`` (label = the value) and ``countdown`` (label = JSON
    {"numbers": [...], "target": n}) requests; None for every other task (no expansion rule then)."""
    from loom.answers import last_boxed
    from loom.exact import check_arithmetic, check_countdown, parse_countdown

    label = request.label
    if request.task not in ("arithmetic", "countdown") or not label:
        return None
    gold: Any = label
    if request.task == "countdown":
        gold = parse_countdown(label)  # None for a malformed label, whatever its shape
        if gold is None:
            return None

    def score(trajectories: list[Trajectory]) -> list[float]:
        out = []
        for t in trajectories:
            text = tokenizer.decode(t.completion_ids, skip_special_tokens=True)
            answer = last_boxed(text)
            if answer is None:
                out.append(0.0)
            elif request.task == "arithmetic":
                out.append(float(check_arithmetic(answer, gold)))
            else:
                out.append(float(check_countdown(answer, gold[0], gold[1])))
        return out

    return score


class ScorerError(EngineError):
    """The operator's attention scorer failed: unreachable, an error status, or a reply that is not
    the scores. The message names what went wrong, never what the scorer said."""

    kind = "attention_scorer_error"


class ScorerTimeout(ScorerError):
    kind = "attention_scorer_timeout"


def _scores_of(body: Any, n: int) -> list[float]:
    scores = body.get("scores") if isinstance(body, dict) else None
    if (
        not isinstance(scores, list)
        or len(scores) != n
        or not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in scores
        )
    ):
        raise ScorerError(f"the attention scorer's reply is not a list of {n} finite scores")
    return [float(x) for x in scores]


def http_scorer(
    url: str, timeout_s: float = 120.0, token: str = "", policy: tuple[str | None, int] = (None, 0)
) -> Scorer:
    """FCI scores from ``POST {url}/v1/score/attention`` (the learner's route, also on ``loom engine``).
    ``url`` is the operator's (``LOOM_ATTENTION_URL``); ``timeout_s`` bounds the whole call (connect,
    send, every byte of the reply); ``token``: the service token the learner's route requires;
    ``policy``: the (namespace, version) scored under (0: the base model), the rollout's."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    namespace, version = policy
    at = {"policy_version": version, "policy_namespace": None if version == 0 else namespace}

    async def score(
        ids: list[int], steps: list[tuple[int, int]], delta: int, zero_from: int | None
    ) -> list[float]:
        import httpx

        body = {"token_ids": ids, "steps": [list(s) for s in steps], "delta": delta, "zero_from": zero_from}
        body |= at
        try:
            async with asyncio.timeout(timeout_s), httpx.AsyncClient(timeout=timeout_s) as client:
                r = await client.post(url.rstrip("/") + "/v1/score/attention", json=body, headers=headers)
        except (TimeoutError, httpx.TimeoutException):
            raise ScorerTimeout(f"the attention scorer did not answer within {timeout_s} s") from None
        except httpx.HTTPError as exc:
            raise ScorerError(f"the attention scorer could not be reached ({type(exc).__name__})") from None
        if r.status_code == 409:
            raise ScorerError(f"the attention scorer cannot score under policy version {version} (HTTP 409)")
        if r.status_code != 200:
            raise ScorerError(f"the attention scorer answered HTTP {r.status_code}")
        try:
            reply = r.json()
        except ValueError:
            raise ScorerError("the attention scorer's reply is not JSON") from None
        return _scores_of(reply, len(steps))

    return score


def operator_scorer(settings: Settings, cfg: ModeParams) -> PolicyScorer | None:
    """The operator's scorer (``LOOM_ATTENTION_URL``, with the service token), bounded by the
    request's ``attention_timeout_s`` (tree's params; else the deployment's bound), for the policy
    it is given (``resolve_scorer``: the engine's); None where the operator set none."""
    if not settings.attention_url:
        return None
    url, token = settings.attention_url, settings.service_token
    timeout_s = getattr(cfg, "attention_timeout_s", settings.attention_timeout_s)
    return lambda policy: http_scorer(url, timeout_s, token, policy)


def resolve_scorer(engine: Engine, operator: PolicyScorer | None = None) -> Scorer:
    """The engine's own scorer, else the operator's (``operator_scorer``) for the policy ``engine``
    holds: the rollout's, held through the whole generation (rollout_svc.rollout.serving)."""
    if "attention_scores" in engine.capabilities:
        return engine.score_attention
    if operator is not None:
        return operator((engine.policy_namespace, engine.policy_version))
    raise UnsupportedCapability(
        engine.name,
        "attention_scores",
        "use strategy 'entropy' or 'random', or ask the operator to set LOOM_ATTENTION_URL to a learner "
        "or `loom engine` serving /v1/score/attention",
    )
