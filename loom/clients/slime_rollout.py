"""slime's custom generate function with every sample from Loom (docs/interop-rollout.md, "slime").

    --custom-generate-function-path loom.clients.slime_rollout.generate
    --custom-config-path loom.yaml     # loom_url, loom_mode, loom_mode_params, loom_policy_version, ...

How slime calls it (THUDM/slime@624b824, ``slime/rollout/sglang_rollout.py``): ``generate_and_rm``
loads the path (lines 251-260) and awaits ``generate(args, sample, sampling_params, evaluation=...)``
once per ``Sample``; ``generate_and_rm_group`` runs the ``n_samples_per_prompt`` copies of one prompt
(the data source's deep copies, one ``group_index``, ``slime/rollout/data_source.py`` 110-116) at
once under ``asyncio.gather`` (lines 317-327). Loom generates a group per prompt, so the calls of one
``group_index`` share one job with ``n = n_samples_per_prompt``: the first submits it, each takes the
next sample of the group. An evaluation sample (no group) is a job of its own with ``n = 1``.

Each ``Sample`` is filled as slime's own ``generate`` fills it (``Sample.append_response_tokens``):
``tokens`` = Loom's prompt ids + completion ids (token-exact, the replica's tokenizer),
``response_length``, ``response`` (Loom's decoded text: special tokens dropped; the tokens are the
truth), ``loss_mask`` (0 on the tokens the mode inserted: streaming's sentences and forced markers,
spawn's join blocks), ``rollout_log_probs`` (the behaviour log-probs, 0.0 on inserted tokens),
``status`` from the finish reason (``FAILED`` for a spawn rollout's format error: ``slime_status``),
``weight_versions`` (+ the policy version), ``reward`` (the job's
reward spec: its total, or ``{"reward": total, **components}`` under ``--reward-key``;
``loom_use_reward: false`` leaves it to slime's reward model) and ``metadata``
(``loom_policy_version``, ``loom_policy_namespace``, ``loom_trajectory_id``, ``loom_group_id``,
``loom_parent_id``, ``loom_components``, ``loom_reward_status``, ``loom_rollout_status``,
``loom_env_mask``, ``loom_advantages``: tree mode's TreeRL node advantages).

Agent mode (docs/interop-rollout.md, "Agent mode at each trainer's seam"): the ``Sample`` is
filled as slime's multi-turn generate functions fill theirs, with the observations at loss mask 0 and
log-prob 0.0. ``metadata`` adds the episode's turns, tool calls, spans and stop reason, and the
episode's budget is the response length.

Tree: a group keeps ``n_samples_per_prompt`` leaves (``pick_leaves``, from ``initial >= n``
responses). Spawn: the roots (the children's threads have prompts of their own).

The policy each job asks for: ``args.loom_policy_version`` / ``loom_policy_namespace`` /
``loom_policy_match`` (``"exact"`` or ``"at_least"``), or ``set_policy(...)`` between rollouts.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from loom.clients.rollouts import AsyncRollouts, RolloutSample, check_mode_params
from loom.clients.trainer_rows import (
    check_tree_initial,
    episode_of,
    follow_window,
    trainer_mode_params,
    trainer_samples,
)
from loom.contracts.modes import ModeParams
from loom.contracts.policies import PolicyMatch
from loom.contracts.wire import Mode, SamplingParams
from loom.interop import label_text, message_text

# slime's SGLang sampling keys -> Loom's SamplingParams (sglang_rollout.py 95-105, 542-561)
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "max_new_tokens": "max_tokens",
    "stop_token_ids": "stop_token_ids",
    "sampling_seed": "seed",
    "min_new_tokens": "min_tokens",
    "repetition_penalty": "repetition_penalty",
}
_STATUS = {"stop": "COMPLETED", "length": "TRUNCATED", "abort": "ABORTED", "error": "FAILED"}


@dataclass
class Policy:
    version: int | None = None
    namespace: str | None = None
    match: PolicyMatch = "exact"


@dataclass
class _Pending:
    job: asyncio.Task[list[RolloutSample]]
    size: int
    taken: int = 0


class LoomGenerate:
    """The custom generate function (module docstring), bound to one gateway.

    ``mode_params`` are checked here with the mode's own model; ``sampling`` adds to what follows
    slime's sampling params; ``reward`` is the job's ``RewardSpec`` (default accuracy); ``task`` is
    the default task kind (a sample's ``metadata["loom"]`` may give ``task``, ``prompt``,
    ``mode_params``)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        mode: Mode = "plain",
        mode_params: ModeParams | Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        reward: Mapping[str, Any] | None = None,
        task: str | None = None,
        use_reward: bool = True,
        policy: Policy | None = None,
        timeout: float = 600.0,
    ) -> None:
        given = trainer_mode_params(mode, mode_params, "slime")
        # a bad parameter fails here, not mid-rollout (streaming's sentences come with each sample)
        check_mode_params(mode, mode_params, {"sentences": ["x."]} if mode == "streaming" else {})
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self.mode, self.mode_params, self._initial = mode, mode_params, given.get("initial")
        self.sampling, self.reward, self.task = dict(sampling or {}), reward, task
        self.use_reward = use_reward
        self.policy = policy or Policy()
        self.jobs = 0  # jobs submitted (one per slime group)
        self._client: AsyncRollouts | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[Hashable, _Pending] = {}

    def set_policy(
        self, version: int | None, namespace: str | None = None, match: PolicyMatch = "exact"
    ) -> None:
        """The policy the next jobs ask for (None: whatever the replica holds)."""
        self.policy = Policy(version, namespace, match)

    async def __call__(
        self, args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False
    ) -> Any:
        if sample.response_length:
            raise ValueError("a partial rollout cannot be continued by Loom: turn off --partial-rollout")
        if not evaluation and (sampling_params.get("custom_params") or {}).get("return_top_p_token_ids"):
            raise ValueError("slime's top-p replay (--rollout-top-p < 1) needs SGLang's kept token ids")
        grouped = not evaluation and sample.group_index is not None
        key: Hashable = ("group", sample.group_index) if grouped else ("sample", id(sample))
        pending = self._pending.get(key)
        if pending is None:
            size = int(args.n_samples_per_prompt) if grouped else 1
            job = asyncio.ensure_future(self._group(sample, sampling_params, size))
            pending = self._pending[key] = _Pending(job, size)
        i = pending.taken
        pending.taken += 1
        if pending.taken == pending.size:
            del self._pending[key]
        chosen = await asyncio.shield(pending.job)  # one caller cancelled must not cancel the others' job
        fill(sample, chosen[i], reward_key=getattr(args, "reward_key", None), use_reward=self.use_reward)
        return sample

    async def _group(self, sample: Any, sampling_params: Mapping[str, Any], n: int) -> list[RolloutSample]:
        policy = self.policy
        sampling = self._sampling(sampling_params, n)
        groups = await self._rollouts().generate(
            [self._task(sample)],
            mode=self.mode,
            # a whole episode within --rollout-max-response-len, as slime's multi-turn examples budget it
            mode_params=follow_window(self.mode, self.mode_params, sampling.get("max_tokens")),
            sampling=sampling,
            reward=self.reward,
            policy_version=policy.version,
            policy_namespace=None if policy.version is None else policy.namespace,
            policy_match=None if policy.version is None else policy.match,
        )
        self.jobs += 1
        (group,) = groups
        return trainer_samples(group, self.mode, n)

    def _rollouts(self) -> AsyncRollouts:
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:  # httpx's client belongs to one loop
            self._client = AsyncRollouts(self.url, self.api_key, timeout=self.timeout)
            self._loop = loop
        return self._client

    def _task(self, sample: Any) -> dict[str, Any]:
        extra = dict((sample.metadata or {}).get("loom") or {})
        task: dict[str, Any] = {"prompt": extra.get("prompt", message_text(sample.prompt))}
        if sample.label is not None:
            task["label"] = label_text(sample.label)
        if extra.get("task", self.task) is not None:
            task["task"] = extra.get("task", self.task)
        if extra.get("mode_params"):
            task["mode_params"] = dict(extra["mode_params"])
        return task

    def _sampling(self, params: Mapping[str, Any], n: int) -> dict[str, Any]:
        out: dict[str, Any] = {"n": n}
        for theirs, ours in _SAMPLING_KEYS.items():
            if params.get(theirs) is not None:
                out[ours] = params[theirs]
        stop = params.get("stop")
        if stop:
            out["stop"] = [stop] if isinstance(stop, str) else list(stop)
        out |= self.sampling
        check_tree_initial(self.mode, {"initial": self._initial}, n, "n_samples_per_prompt")
        SamplingParams.model_validate(out)  # a bad one fails before the job
        return out


def slime_status(s: RolloutSample) -> str:
    """slime's ``Sample.Status`` name for one of Loom's samples: the finish reason's, except a spawn
    rollout that ended in a format error (the offending call's ``finish_reason`` is ``"abort"``;
    every call of the rollout has ``meta["rollout_status"] == "format_error"``,
    rollout_svc/modes/spawn.py). slime reads ``ABORTED`` as an engine abort to generate again
    (``fully_async_rollout.py`` requeues the group; a partial rollout continues it, which Loom
    refuses) and ``FAILED`` as a parsing error whose output stands (``slime/utils/types.py``
    ``Sample.Status``): the format error is the policy's, scored by the job's reward, so ``FAILED``.
    An agent episode that ran out of its wall time (``stop_reason`` ``deadline``, finish ``abort``)
    is ``TRUNCATED``: its turns stand, and a new try would meet the same deadline."""
    if s.trajectory.meta.get("rollout_status") == "format_error":
        return "FAILED"
    if s.trajectory.stop_reason == "deadline":  # an agent episode out of wall time: its output stands
        return "TRUNCATED"
    return _STATUS[s.trajectory.finish_reason]


def fill(sample: Any, s: RolloutSample, *, reward_key: str | None = None, use_reward: bool = True) -> None:
    """Fill slime's ``Sample`` with one of Loom's samples (as ``Sample.append_response_tokens`` would
    with the mode's inserted tokens appended ``trainable=False``)."""
    if s.logprobs is None:
        raise ValueError(f"trajectory {s.id} has no behaviour log-probs")
    status = type(sample).Status
    ep = episode_of(s)
    sample.tokens = list(s.prompt_ids) + list(s.completion_ids)
    sample.response = s.text or ""
    sample.response_length = len(s.completion_ids)
    sample.loss_mask = list(s.loss_mask)
    sample.rollout_log_probs = list(s.logprobs)
    sample.status = getattr(status, slime_status(s))
    sample.weight_versions = [*sample.weight_versions, str(s.policy_version)]
    if use_reward and s.reward is not None:
        sample.reward = {"reward": s.reward, **s.components} if reward_key else s.reward
    sample.metadata = dict(sample.metadata or {}) | {
        "loom_policy_version": s.policy_version,
        "loom_policy_namespace": s.policy_namespace,
        "loom_trajectory_id": s.id,
        "loom_group_id": s.trajectory.group_id,
        "loom_parent_id": s.trajectory.parent_id,
        "loom_components": dict(s.components),
        "loom_reward_status": s.reward_status,
        "loom_rollout_status": s.trajectory.meta.get("rollout_status", "ok"),
        "loom_env_mask": list(s.env_mask),
        "loom_advantages": s.advantages,
        "loom_stop_reason": ep["stop_reason"],
        "loom_turns": ep["turns"],
        "loom_tool_calls": ep["tool_calls"],
        "loom_turn_spans": ep["turn_spans"],
        "loom_observation_spans": ep["observation_spans"],
    }


_INSTANCES: dict[tuple[Any, ...], LoomGenerate] = {}


def from_args(args: Any) -> LoomGenerate:
    """The ``LoomGenerate`` slime's args describe (``--custom-config-path`` puts a YAML's keys on
    them): ``loom_url``, ``loom_api_key`` (or the env var ``loom_api_key_env``, default
    ``LOOM_API_KEY``), ``loom_mode``, ``loom_mode_params``, ``loom_sampling``, ``loom_reward``,
    ``loom_task``, ``loom_use_reward``, ``loom_policy_version``, ``loom_policy_namespace``,
    ``loom_policy_match``. One per process and configuration."""
    conf = {k: getattr(args, k) for k in vars(args) if k.startswith("loom_")}
    key = tuple(sorted((k, repr(v)) for k, v in conf.items()))
    found = _INSTANCES.get(key)
    if found is None:
        api_key = conf.get("loom_api_key") or os.environ.get(conf.get("loom_api_key_env") or "LOOM_API_KEY")
        found = _INSTANCES[key] = LoomGenerate(
            conf["loom_url"],
            api_key,
            mode=conf.get("loom_mode") or "plain",
            mode_params=conf.get("loom_mode_params"),
            sampling=conf.get("loom_sampling"),
            reward=conf.get("loom_reward"),
            task=conf.get("loom_task"),
            use_reward=bool(conf.get("loom_use_reward", True)),
            policy=Policy(
                conf.get("loom_policy_version"),
                conf.get("loom_policy_namespace"),
                conf.get("loom_policy_match") or "exact",
            ),
        )
    return found


async def generate(args: Any, sample: Any, sampling_params: dict[str, Any], evaluation: bool = False) -> Any:
    """``--custom-generate-function-path loom.clients.slime_rollout.generate``."""
    return await from_args(args)(args, sample, sampling_params, evaluation=evaluation)
