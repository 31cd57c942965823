"""TRL 1.16's ``GRPOTrainer(rollout_func=...)`` with every rollout from Loom (docs/interop-rollout.md, "TRL").

    rollout = LoomRolloutFunc(url, api_key, mode="tree", tasks=tasks, publish=publish_with(publisher))
    trainer = GRPOTrainer(model, reward_funcs=[job_reward], rollout_func=rollout, args=GRPOConfig(...))

How TRL calls it (trl/trainer/grpo_trainer.py, ``_generate``): ``rollout_func(prompts, trainer)``
with this process's prompts, each repeated ``num_generations`` times in a row (the RepeatSampler's
order), and no vLLM needed (``use_vllm=False``). It returns, one entry per prompt given:
``prompt_ids``, ``completion_ids``, ``logprobs`` (Loom's behaviour log-probs where they are of
the tempered distribution TRL recomputes, None per token where not: ``trl_logprobs``), ``env_mask`` (TRL
multiplies it into its loss mask: Loom's trained tokens, so inserted observations, forced markers and
join blocks are never trained) and extra fields that reach the reward functions as columns:
``loom_reward`` (the total the job's reward spec gave; ``job_reward`` returns it), ``loom_components``,
``loom_policy_version``, ``loom_trajectory_id``, ``loom_group_id``.

One Loom group per distinct prompt, with ``n = num_generations``; a tree (its leaf count varies)
starts from ``initial >= num_generations`` responses, so it always has enough leaves, and
``num_generations`` of them are kept, whole subtrees first (``pick_leaves``; ``leaves="spread"``:
spread over the expanded responses, which let the reward rise more in docs/interop-rollout.md's
runs). Spawn keeps the
roots (children's threads have prompts of their own); reflection revisions and adaptive sampling
change a group's size and are refused here (the ``Rollouts`` client has them).

Agent mode (docs/interop-rollout.md, "Agent mode at each trainer's seam"): ``env_mask`` is 0 on the
tools' observations, and ``loom_turns``, ``loom_tool_calls``, ``loom_stop_reason`` are columns.
``tools=[...]`` takes TRL-style tool functions named as Loom's built-ins (Loom runs its own). A
trainer built with ``tools`` or ``environment_factory`` is refused, because TRL's tool loop would run
after ``rollout_func`` and replace ``env_mask``.

Policy versions: before the rollouts of a step, when ``trainer.state.global_step`` has advanced past
the last published step, the trainer's weights are published as version ``global_step`` through
``publish`` (``publish_with(PolicyPublisher(...))``, loom/clients/policies.py; any
``(model, version) -> PublishedVersion`` function), and the job asks for that version, so every
trajectory records the step it was generated for. Step 0 is the model the deployment starts from
(version 0) unless ``publish_initial``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from loom.clients.rollouts import Rollouts, RolloutSample
from loom.clients.trainer_rows import (
    Leaves,
    check_tree_initial,
    episode_of,
    follow_window,
    loom_tools,
    trainer_mode_params,
    trainer_samples,
)
from loom.contracts.modes import ModeParams
from loom.contracts.policies import PolicyMatch
from loom.contracts.wire import Mode
from loom.interop import label_text, message_text


class PublishedVersion(NamedTuple):
    namespace: str | None
    version: int


Publish = Callable[[Any, int], PublishedVersion]


class _Publisher(Protocol):
    def publish_model(self, model: Any, tokenizer: Any = None, version: int | None = None) -> Any: ...


def publish_with(publisher: _Publisher, tokenizer: Any = None) -> Publish:
    """``publish`` through a ``PolicyPublisher`` (the key's namespace, the given version)."""

    def publish(model: Any, version: int) -> PublishedVersion:
        ref = publisher.publish_model(model, tokenizer, version=version)
        fields = (
            dict(ref) if isinstance(ref, Mapping) else {k: getattr(ref, k) for k in ("namespace", "version")}
        )
        return PublishedVersion(fields.get("namespace"), int(fields["version"]))

    return publish


def trl_logprobs(sample: RolloutSample, temperature: float) -> list[float | None]:
    """The sample's behaviour log-probs as TRL reads them: of its logits divided by ``temperature``
    (what TRL recomputes, and what vLLM's ``processed_logprobs`` give it). Loom's are that
    distribution's when they are 'processed' ones of this temperature, or 'raw' ones (the model's own)
    at temperature 1; any others (raw ones of a tempered sampling: the deployment's
    ``engine_logprobs_mode`` is 'raw') are not, and are returned as None per token, which TRL reads as
    NaN and leaves out of its vLLM importance correction (ratio 1) instead of correcting by the gap
    between two temperatures."""
    t = sample.trajectory
    if sample.logprobs is None:
        return [None] * len(sample.completion_ids)
    if t.logprobs_kind == "processed":
        proc = t.logprobs_processing
        usable = proc is not None and abs(proc.temperature - temperature) < 1e-6
    else:
        usable = abs(temperature - 1.0) < 1e-6
    return list(sample.logprobs) if usable else [None] * len(sample.completion_ids)


def job_reward(
    completions: list[Any], loom_reward: list[float | None] | None = None, **_: Any
) -> list[float]:
    """A TRL reward function: the reward Loom's job gave each completion (``loom_reward`` column)."""
    if loom_reward is None:
        raise ValueError("job_reward needs the loom_reward column: use it with LoomRolloutFunc")
    return [0.0 if r is None else float(r) for r in loom_reward]


Tasks = Callable[[Any], Mapping[str, Any]] | Mapping[str, Mapping[str, Any]]


class LoomRolloutFunc:
    """``rollout_func`` for ``GRPOTrainer`` (module docstring).

    ``tasks`` maps a TRL prompt to its Loom task ``{"prompt", "label", "task", "mode_params"}`` (a
    function of the prompt, or a dict keyed by the prompt's text): the label the job's reward reads,
    and per-item mode parameters (streaming's sentences). Without it, the prompt's text is the task
    and there is no label. ``sampling`` adds to what follows the trainer (``n = num_generations``,
    ``max_tokens = max_completion_length``, temperature, top-p, top-k)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        mode: Mode = "plain",
        mode_params: ModeParams | Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        reward: Mapping[str, Any] | None = None,
        tasks: Tasks | None = None,
        publish: Publish | None = None,
        publish_initial: bool = False,
        policy_namespace: str | None = None,
        policy_match: PolicyMatch = "exact",
        timeout: float = 600.0,
        leaves: Leaves = "subtree",
        tools: Sequence[Any] | None = None,
    ) -> None:
        if tools is not None:  # TRL-style tool functions, served by Loom's own built-ins of those names
            if mode != "agent":
                raise ValueError("LoomRolloutFunc(tools=...) is agent mode's: set mode='agent'")
            mode_params = _with_tools(mode_params, loom_tools(tools, "TRL"))
        self._params = trainer_mode_params(mode, mode_params, "TRL")  # as a dict, checked once
        self.rollouts = Rollouts(url, api_key, timeout=timeout)
        self.mode, self.mode_params, self.leaves = mode, mode_params, leaves
        self.sampling, self.reward, self.tasks = dict(sampling or {}), reward, tasks
        self.publish, self.publish_initial = publish, publish_initial
        self.namespace, self.match = policy_namespace, policy_match
        self.published: int | None = None  # the trainer step last published
        # step 0 is the deployment's base model (version 0 in every namespace) unless it is published
        self.version: int | None = 0 if publish is not None and not publish_initial else None
        self.history: list[dict[str, Any]] = []  # per call: step, version, the samples' versions

    # ---- TRL's entry
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if getattr(trainer, "tools", None):
            # TRL's own tool loop would run over Loom's finished episodes and replace env_mask
            raise ValueError(
                "GRPOTrainer(tools=/environment_factory=) runs TRL's tool loop after rollout_func and "
                "drops its env_mask: pass the tools to LoomRolloutFunc(mode='agent', tools=...) instead"
            )
        step = int(trainer.state.global_step)
        self._sync(trainer, step)
        g = int(trainer.num_generations if trainer.model.training else trainer.num_generations_eval)
        if len(prompts) % g:
            raise ValueError(
                f"rollout_func got {len(prompts)} prompts, not a multiple of num_generations={g}"
            )
        unique = [prompts[i] for i in range(0, len(prompts), g)]
        for i, p in enumerate(unique):
            if any(q != p for q in prompts[i * g : (i + 1) * g]):
                raise ValueError(
                    "rollout_func expects each prompt num_generations times in a row (RepeatSampler)"
                )
        groups = self.rollouts.generate(
            [self._task(p, trainer) for p in unique],
            mode=self.mode,
            mode_params=follow_window(self.mode, self.mode_params, int(trainer.max_completion_length)),
            sampling=self._sampling(trainer, g),
            reward=self.reward,
            policy_version=self.version,
            policy_namespace=None if self.version is None else self.namespace,
            policy_match=None if self.version is None else self.match,
        )
        out: dict[str, list[Any]] = {k: [] for k in _KEYS}
        for group in groups:
            for s in trainer_samples(group, self.mode, g, leaves=self.leaves):
                out["prompt_ids"].append(s.prompt_ids)
                out["completion_ids"].append(s.completion_ids)
                out["logprobs"].append(trl_logprobs(s, float(trainer.temperature)))
                out["env_mask"].append(s.loss_mask)
                out["loom_reward"].append(s.reward)
                out["loom_components"].append(s.components)
                out["loom_policy_version"].append(s.policy_version)
                out["loom_policy_namespace"].append(s.policy_namespace)
                out["loom_trajectory_id"].append(s.id)
                out["loom_group_id"].append(s.trajectory.group_id)
                ep = episode_of(s)
                out["loom_turns"].append(ep["turns"])
                out["loom_tool_calls"].append(ep["tool_calls"])
                out["loom_stop_reason"].append(ep["stop_reason"])
        self.history.append(
            {
                "step": step,
                "version": self.version,
                "namespace": self.namespace if self.version is not None else None,
                "versions": out["loom_policy_version"],
                "namespaces": out["loom_policy_namespace"],
            }
        )
        return out

    def _sync(self, trainer: Any, step: int) -> None:
        """Publish the trainer's weights as version ``step`` once per step that trained."""
        if self.publish is None or step == self.published or (step == 0 and not self.publish_initial):
            return
        model = trainer.model
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            model = accelerator.unwrap_model(model)
        ref = self.publish(model, step)
        self.published, self.version = step, ref.version
        if ref.namespace is not None:
            self.namespace = ref.namespace

    def _task(self, prompt: Any, trainer: Any) -> dict[str, Any]:
        text = _prompt_text(prompt, trainer)
        if self.tasks is None:
            return {"prompt": text}
        key = message_text(prompt)
        found = self.tasks(prompt) if callable(self.tasks) else self.tasks.get(key)
        if found is None:
            raise KeyError(f"no Loom task for the prompt {key[:80]!r}")
        task = dict(found)
        task.setdefault("prompt", text)
        if "label" in task:
            task["label"] = label_text(task["label"])
        return task

    def _sampling(self, trainer: Any, g: int) -> dict[str, Any]:
        top_k = getattr(trainer, "top_k", None)
        follows: dict[str, Any] = {
            "n": g,
            "max_tokens": int(trainer.max_completion_length),
            "temperature": float(trainer.temperature),
            "top_p": float(getattr(trainer, "top_p", 1.0) or 1.0),
            "top_k": int(top_k) if top_k else -1,
        }
        check_tree_initial(self.mode, self._params, g, "num_generations")
        return follows | self.sampling

    def close(self) -> None:
        self.rollouts.close()


_KEYS = (
    "prompt_ids",
    "completion_ids",
    "logprobs",
    "env_mask",
    "loom_reward",
    "loom_components",
    "loom_policy_version",
    "loom_policy_namespace",
    "loom_trajectory_id",
    "loom_group_id",
    "loom_turns",
    "loom_tool_calls",
    "loom_stop_reason",
)


def _with_tools(mode_params: ModeParams | Mapping[str, Any] | None, tools: list[str]) -> Any:
    if isinstance(mode_params, ModeParams):
        return mode_params.model_copy(update={"tools": tools})
    return dict(mode_params or {}) | {"tools": tools}


def _prompt_text(prompt: Any, trainer: Any) -> str:
    """A TRL prompt as the text Loom conditions on: a chat prompt through the tokenizer's template."""
    if isinstance(prompt, str):
        return prompt
    tok = getattr(trainer, "processing_class", None)
    if tok is not None and getattr(tok, "chat_template", None):
        return str(tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True))
    return message_text(prompt)


def off_policy_calls(history: Sequence[Mapping[str, Any]], staleness: int = 0) -> list[str]:
    """The calls whose samples carry a policy version outside [step - staleness, step], or a namespace
    other than the one the call asked for (empty: every sample is the trainer's step's)."""
    bad = []
    for h in history:
        off = [v for v in h["versions"] if not h["step"] - staleness <= v <= h["step"]]
        if off:
            bad.append(f"step {h['step']}: versions {sorted(set(off))}")
        others = {ns for ns in h["namespaces"] if ns != h["namespace"]}
        if h["version"] is not None and others:
            bad.append(f"step {h['step']}: namespaces {sorted(map(str, others))}")
    return bad
