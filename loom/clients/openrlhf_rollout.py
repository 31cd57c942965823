"""OpenRLHF 0.11.2's agent executor (``--train.agent_func_path``) with every rollout from Loom
(docs/interop-rollout.md, "OpenRLHF").

    # loom_agent.py, the file --train.agent_func_path names
    from loom.clients.openrlhf_rollout import LoomAgentExecutor

    class AgentExecutor(LoomAgentExecutor):
        def __init__(self):
            super().__init__(URL, API_KEY, n_samples_per_prompt=8, mode="tree", task="arithmetic")

How OpenRLHF calls it (openrlhf/trainer/ray/vllm_engine.py): ``_load_agent_executor`` runs the file,
checks that its ``AgentExecutor`` subclasses ``AgentExecutorBase`` and builds it without arguments;
``RolloutRayActor.generate_responses(prompt, label, sampling_params, max_length, hf_tokenizer,
num_samples)`` gathers ``num_samples`` concurrent ``execute`` calls, one sample each; then
``SamplesGenerator._process_response_into_experience`` (ppo_utils/samples_generator.py) turns each
answer into an ``Experience``: ``action_mask`` from ``action_ranges``, ``rollout_log_probs`` aligned to
``observation_tokens``, ``reward``/``scores`` and one ``info`` tensor per ``extra_logs`` entry.

The ``num_samples`` calls of one prompt share one Loom group: the first starts a job with
``n = n_samples_per_prompt`` (which must equal the trainer's ``--rollout.n_samples_per_prompt``) and
each call takes the next sample of it. Each answer holds the sample's tokens as Loom produced them
(``observation_tokens`` = prompt + completion), ``action_ranges`` = the runs of Loom's trained tokens
(inserted observations, forced markers, join blocks and an untrained tree prefix are outside every
range, so out of OpenRLHF's ``action_mask``), the behaviour log-probs (0.0 on the prompt and on
inserted tokens), the job's reward (``reward``; ``scores`` its accuracy component, which dynamic
filtering reads), and ``extra_logs`` with the reward components and ``loom_policy_version``.

An agent episode (docs/interop-rollout.md, "Agent mode at each trainer's seam") comes back as
``MultiTurnAgentExecutor`` lays one out: one action range per policy turn, the observations outside
them with log-prob 0.0, the episode's budget ``max_length`` less the prompt.

A tree keeps ``n`` of its leaves (``pick_leaves``: whole subtrees first) and spawn
its roots: OpenRLHF normalises rewards over exactly ``n_samples_per_prompt`` consecutive samples of a prompt
(``compute_advantages_and_returns``), so a group never gives it more or fewer.

Policy versions: ``policy_version`` an integer, ``"latest"`` (the newest version the key has published,
read at each group; 0, the deployment's base model, before any) or a function returning one;
``policy_match`` ``"exact"`` or ``"at_least"``. The executor runs in the rollout actor, which holds no
trainer weights: the trainer publishes them (``PolicyPublisher``) after it syncs them to its engines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from openrlhf.utils.agent import AgentExecutorBase  # openrlhf==0.11.2 (deploy/setup.sh)

from loom.clients.rollouts import AsyncRollouts, RolloutGroup, RolloutSample
from loom.clients.trainer_rows import (
    check_tree_initial,
    episode_of,
    follow_window,
    trainer_mode_params,
    trainer_samples,
)
from loom.contracts.modes import ModeParams
from loom.contracts.policies import PolicyMatch
from loom.contracts.wire import Mode
from loom.interop import label_text

PolicyVersion = int | Literal["latest"] | Callable[[], int | None | Awaitable[int | None]] | None
Tasks = Callable[[str, Any], Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]


def action_ranges(prompt_len: int, trained: list[int]) -> list[tuple[int, int]]:
    """The runs of trained tokens as ``[start, end)`` positions in prompt + completion."""
    ranges: list[tuple[int, int]] = []
    start: int | None = None
    for j, m in enumerate([*trained, 0]):
        if m and start is None:
            start = j
        elif not m and start is not None:
            ranges.append((prompt_len + start, prompt_len + j))
            start = None
    return ranges


def response(prompt: str, label: Any, s: RolloutSample) -> dict[str, Any]:
    """One sample as ``AgentExecutorBase.execute`` returns it (the keys ``_process_response_into_experience``
    reads; ``loom`` is Loom's record of the sample, which OpenRLHF passes over)."""
    logprobs = s.logprobs if s.logprobs is not None else [0.0] * len(s.completion_ids)
    extra: dict[str, float] = {k: float(v) for k, v in s.components.items()}
    extra["loom_policy_version"] = float(s.policy_version)
    ep = episode_of(s)
    extra["loom_turns"], extra["loom_tool_calls"] = float(ep["turns"]), float(ep["tool_calls"])
    return {
        "prompt": prompt,
        "label": label,
        "images": None,
        "mm_train_inputs": None,
        "observation_tokens": [*s.prompt_ids, *s.completion_ids],
        "action_ranges": action_ranges(len(s.prompt_ids), s.loss_mask),
        "rollout_log_probs": [0.0] * len(s.prompt_ids) + list(logprobs),
        "truncated": s.trajectory.finish_reason == "length",
        "reward": 0.0 if s.reward is None else float(s.reward),
        "scores": float(s.components.get("accuracy", 0.0 if s.reward is None else s.reward)),
        "extra_logs": extra,
        "loom": {
            "trajectory_id": s.id,
            "group_id": s.trajectory.group_id,
            "policy_version": s.policy_version,
            "policy_namespace": s.policy_namespace,
            "parent_id": s.trajectory.parent_id,
            "stop_reason": ep["stop_reason"],
            "turn_spans": ep["turn_spans"],
            "observation_spans": ep["observation_spans"],
        },
    }


@dataclass
class _Batch:
    """The ``execute`` calls of one prompt that share one Loom group."""

    job: asyncio.Future[list[RolloutSample]]
    taken: int = 0


class LoomAgentExecutor(AgentExecutorBase):
    """``AgentExecutorBase`` whose samples come from Loom (module docstring).

    ``task`` names the reward family of the job's items (``"arithmetic"``); ``tasks`` maps a prompt (a
    function of ``(prompt, label)``, or a dict keyed by the prompt) to its Loom task ``{"prompt",
    "label", "task", "mode_params"}`` where it differs (streaming's sentences, a prompt of Loom's
    own). ``sampling`` adds to what follows the trainer's ``SamplingParams`` (temperature, top-p,
    top-k, min_tokens, ``max_tokens`` or, unset, ``max_length`` less the prompt)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        n_samples_per_prompt: int,
        mode: Mode = "plain",
        mode_params: ModeParams | Mapping[str, Any] | None = None,
        task: str | None = None,
        tasks: Tasks | None = None,
        sampling: Mapping[str, Any] | None = None,
        reward: Mapping[str, Any] | None = None,
        policy_version: PolicyVersion = None,
        policy_namespace: str | None = None,
        policy_match: PolicyMatch = "exact",
        timeout: float = 600.0,
    ) -> None:
        params = trainer_mode_params(mode, mode_params, "OpenRLHF")
        check_tree_initial(mode, params, n_samples_per_prompt, "n_samples_per_prompt")
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self.n, self.mode, self.mode_params = n_samples_per_prompt, mode, mode_params
        self.task, self.tasks, self.sampling, self.reward = task, tasks, dict(sampling or {}), reward
        self.policy_version, self.namespace, self.match = policy_version, policy_namespace, policy_match
        self._open: dict[str, _Batch] = {}
        self._client: tuple[asyncio.AbstractEventLoop, AsyncRollouts] | None = None
        self.groups: list[RolloutGroup] = []  # every group received, in arrival order

    # ---- OpenRLHF's entry (AgentExecutorBase.execute)
    async def execute(  # type: ignore[override]
        self,
        prompt: str,
        label: Any,
        sampling_params: Any,
        max_length: int,
        hf_tokenizer: Any,
        llm_engine: Any,
        images: Any = None,
    ) -> dict[str, Any]:
        if images:
            raise ValueError("LoomAgentExecutor serves text prompts only")
        key = json.dumps([prompt, repr(label)])
        batch = self._open.get(key)
        if batch is None or batch.taken >= self.n or batch.job.done():
            job = asyncio.ensure_future(self._group(prompt, label, sampling_params, max_length, hf_tokenizer))
            batch = self._open[key] = _Batch(job)
        i = batch.taken
        batch.taken += 1
        if batch.taken >= self.n:
            del self._open[key]
        samples = await batch.job
        return response(prompt, label, samples[i])

    async def _group(
        self, prompt: str, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any
    ) -> list[RolloutSample]:
        rollouts = self._rollouts()
        version, namespace = await self._version(rollouts)
        item = self._task(prompt, label)
        sampling = self._sampling(item, sampling_params, max_length, hf_tokenizer)
        prompt_len = len(hf_tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
        (group,) = await rollouts.generate(
            [item],
            mode=self.mode,
            # an episode fits max_length as MultiTurnAgentExecutor's does (prompt, turns, observations)
            mode_params=follow_window(self.mode, self.mode_params, max(1, max_length - prompt_len)),
            sampling=sampling,
            reward=self.reward,
            policy_version=version,
            policy_namespace=namespace if version is not None else None,
            policy_match=self.match if version is not None else None,
        )
        self.groups.append(group)
        return trainer_samples(group, self.mode, self.n)

    def _rollouts(self) -> AsyncRollouts:
        """One client per event loop (Ray's actor keeps one; each ``asyncio.run`` makes another)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client[0] is not loop:
            self._client = (loop, AsyncRollouts(self.url, self.api_key, timeout=self.timeout))
        return self._client[1]

    async def _version(self, rollouts: AsyncRollouts) -> tuple[int | None, str | None]:
        want = self.policy_version
        if want == "latest":
            r = await rollouts.http.get("/v1/policies")
            r.raise_for_status()
            refs = r.json()
            if not refs:
                return 0, None  # version 0: the deployment's base model, in every namespace
            newest = max(refs, key=lambda ref: int(ref["version"]))
            return int(newest["version"]), newest.get("namespace")
        if callable(want):
            got = want()
            version = await got if isinstance(got, Awaitable) else got
            return version, self.namespace
        return want, self.namespace

    def _task(self, prompt: str, label: Any) -> dict[str, Any]:
        found: Mapping[str, Any] | None = None
        if callable(self.tasks):
            found = self.tasks(prompt, label)
        elif self.tasks is not None:
            found = self.tasks.get(prompt)
            if found is None:
                raise KeyError(f"no Loom task for the prompt {prompt[:80]!r}")
        # OpenRLHF passes "" when the dataset has no --label_key: no label, the reward's status says so
        unlabelled = isinstance(label, str) and label == ""
        item: dict[str, Any] = {"prompt": prompt, "label": None if unlabelled else label_text(label)}
        if self.task is not None:
            item["task"] = self.task
        item.update(found or {})
        if "label" in (found or {}):
            item["label"] = label_text(item["label"])
        return item

    def _sampling(
        self, item: Mapping[str, Any], sampling_params: Any, max_length: int, hf_tokenizer: Any
    ) -> dict[str, Any]:
        """Loom's sampling from the trainer's vLLM ``SamplingParams`` (samples_generator.py,
        ``_dispatch_prompts_to_vllm``); ``max_tokens`` None is OpenRLHF's "the rest of max_length"."""
        max_tokens = getattr(sampling_params, "max_tokens", None)
        if max_tokens is None:
            prompt_len = len(hf_tokenizer(item["prompt"], add_special_tokens=False)["input_ids"])
            max_tokens = max(1, max_length - prompt_len)
        top_k = getattr(sampling_params, "top_k", -1)
        follows = {
            "n": self.n,
            "max_tokens": int(max_tokens),
            "temperature": float(getattr(sampling_params, "temperature", 1.0)),
            "top_p": float(getattr(sampling_params, "top_p", 1.0)),
            "top_k": int(top_k) if top_k and top_k > 0 else -1,
            "min_tokens": int(getattr(sampling_params, "min_tokens", 0) or 0),
        }
        return follows | self.sampling
