"""verl 0.9.1's agent loop with every rollout from Loom (docs/interop-rollout.md, "verl").

A verl user names it in config, the way verl names its own agent loops
(``verl/experimental/agent_loop/agent_loop.py``: ``register`` and ``agent_loop_config_path``)::

    # loom_agent.yaml                          (actor_rollout_ref.rollout.agent.agent_loop_config_path)
    - name: loom
      _target_: loom.clients.verl_rollout.LoomAgentLoop
      url: http://gateway:8400
      mode: tree
      mode_params: {strategy: entropy, branches: 1}
      policy_version: latest                   # or an int, or null; policy_match: exact | at_least

    actor_rollout_ref.rollout.agent.default_agent_loop=loom   (or a dataset column agent_name=loom)

How verl calls it: ``AgentLoopWorker.generate_sequences`` starts one ``run(sampling_params, **row)``
per row of its chunk of the batch (each prompt repeated ``rollout.n`` times in a row, sharing a
``uid``), all at once, then pads what each returns (``_agent_loop_postprocess``). verl's loop is one
sample per row; Loom's modes are one group per prompt. So the rows of one ``generate_sequences`` call
join one Loom job: each row registers its ``uid`` and yields once to the event loop (every row's
task was created before any of them ran, so all have registered by then), the first row to resume
submits the job (one task per distinct ``uid``, ``n`` = the most rows of a ``uid``), and each row
takes its own sample of its ``uid``'s group. A tree keeps the first ``n`` leaves in subtree order
(``pick_leaves``; ``initial >= n`` so there are enough), spawn the roots.

Each row's ``AgentLoopOutput``: the sample's ``prompt_ids`` and ``completion_ids`` (token-exact),
``response_mask`` = Loom's ``loss_mask`` (0 on the tokens the mode inserted: streaming's sentences
and markers, spawn's join blocks, an untrained tree prefix), ``response_logprobs`` = the behaviour
log-probs (verl's ``rollout_log_probs``), ``reward_score`` = the job's reward (verl's ``rm_scores``;
``use_reward: false`` leaves scoring to verl's reward loop), and in ``extra_fields`` (verl's
non-tensor batch): ``loom_policy_version``, ``loom_policy_namespace``, ``loom_trajectory_id``,
``loom_group_id``, ``loom_reward``, ``loom_components``, ``loom_env_mask`` and ``loom_advantages``
(tree mode's TreeRL per-token advantages, else None).

The row's Loom task: ``extra_info["loom"]`` may hold ``prompt`` (else ``raw_prompt``: a text as it is,
chat messages through the tokenizer's chat template), ``task``, ``mode_params`` (over the config's);
the label is ``reward_model["ground_truth"]`` (``label_text``); the task else ``extra_info["task"]``.

Policy version: ``policy_version`` an int (with ``policy_namespace`` and ``policy_match``, as the
contract allows: ``exact`` or ``at_least``), ``"latest"`` (the newest version the key has published
into its namespace, read once per job from ``GET /v1/policies``; 0, the base model, before any;
``exact`` unless ``policy_match`` says otherwise) or null (whatever the replica holds). verl's
trainer publishes its weights to Loom after each update (``PolicyPublisher``, loom/clients/policies.py),
where it would sync them to its own rollout servers (``checkpoint_manager.update_weights``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from loom.clients.policies import PolicyPublisher
from loom.clients.rollouts import AsyncRollouts, RolloutSample
from loom.clients.trainer_rows import (
    check_tree_initial,
    episode_of,
    follow_window,
    loom_tools,
    trainer_mode_params,
    trainer_samples,
)
from loom.contracts.policies import PolicyMatch
from loom.contracts.wire import Mode
from loom.interop import label_text, message_text, plain

LATEST = "latest"


@dataclass
class LoomSettings:
    """The agent loop's own keys (its entry in ``agent_loop_config_path``)."""

    url: str
    api_key: str | None = field(repr=False)  # the settings' repr keys the open jobs; no secret in it
    mode: Mode = "plain"
    mode_params: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    reward: dict[str, Any] | None = None
    policy_version: int | str | None = None
    policy_namespace: str | None = None
    policy_match: PolicyMatch | None = None
    use_reward: bool = True
    timeout: float = 600.0


@register("loom")
class LoomAgentLoop(AgentLoopBase):
    """One row of verl's batch as one sample of a Loom job (module docstring)."""

    def __init__(
        self,
        *args: Any,
        url: str | None = None,
        api_key: str | None = None,
        api_key_env: str = "LOOM_API_KEY",
        mode: Mode = "plain",
        mode_params: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        reward: Mapping[str, Any] | None = None,
        policy_version: int | str | None = None,
        policy_namespace: str | None = None,
        policy_match: PolicyMatch | None = None,
        use_reward: bool = True,
        timeout: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        url = url or os.environ.get("LOOM_GATEWAY_URL")
        if not url:
            raise ValueError("LoomAgentLoop needs url (its agent loop config) or LOOM_GATEWAY_URL")
        params = trainer_mode_params(mode, plain(mode_params), "verl")
        if isinstance(policy_version, str) and policy_version != LATEST:
            raise ValueError(f"policy_version must be an int, {LATEST!r} or null, not {policy_version!r}")
        if policy_match not in (None, "exact", "at_least"):
            raise ValueError(f"policy_match must be 'exact' or 'at_least', not {policy_match!r}")
        self.settings = LoomSettings(
            url=url,
            api_key=api_key or os.environ.get(api_key_env),
            mode=mode,
            mode_params=params,
            sampling=dict(plain(sampling) or {}),
            reward=plain(reward),
            policy_version=policy_version,
            policy_namespace=policy_namespace,
            policy_match=policy_match,
            use_reward=use_reward,
            timeout=timeout,
        )
        self.response_length = int(self.rollout_config.response_length)
        self.prompt_length = int(self.rollout_config.prompt_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        started = time.perf_counter()
        task = self._task(kwargs)
        key = (id(asyncio.get_running_loop()), repr(self.settings), repr(sorted(sampling_params.items())))
        job = _open.get(key)
        if job is None or job.started:
            job = _open[key] = _Job(self.settings, sampling_params, self.response_length)
        uid = str(kwargs.get("uid", id(self)))
        slot = job.join(uid, task)
        await asyncio.sleep(0)  # every row of verl's call registers before the job starts
        if _open.get(key) is job:
            del _open[key]
        s, group_id = await job.sample(uid, slot)
        return self._output(s, group_id, time.perf_counter() - started)

    def _task(self, row: Mapping[str, Any]) -> dict[str, Any]:
        extra = plain(row.get("extra_info")) or {}
        own = dict(extra.get("loom") or {}) if isinstance(extra, Mapping) else {}
        task: dict[str, Any] = {"prompt": own.get("prompt") or self._prompt_text(row["raw_prompt"])}
        reward_model = plain(row.get("reward_model")) or {}
        if isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None:
            task["label"] = label_text(reward_model["ground_truth"])
        kind = own.get("task") or (extra.get("task") if isinstance(extra, Mapping) else None)
        if kind:
            task["task"] = str(kind)
        if own.get("mode_params"):
            task["mode_params"] = dict(own["mode_params"])
        return task

    def _prompt_text(self, raw: Any) -> str:
        raw = plain(raw)
        if isinstance(raw, str):
            return raw
        tok: Any = self.tokenizer
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(
                list(raw), tokenize=False, add_generation_prompt=True, **dict(self.apply_chat_template_kwargs)
            )
            return str(text)
        return message_text(raw)

    def _output(self, s: RolloutSample, group_id: str, seconds: float) -> AgentLoopOutput:
        if len(s.prompt_ids) > self.prompt_length:
            # verl would cut it from the left; the log-probs were conditioned on all of it
            raise ValueError(
                f"Loom's prompt has {len(s.prompt_ids)} tokens, "
                f"over rollout.prompt_length={self.prompt_length}"
            )
        n = self.response_length
        logprobs = s.logprobs if s.logprobs is not None else [0.0] * len(s.completion_ids)
        ep = episode_of(s)
        return AgentLoopOutput(
            prompt_ids=list(s.prompt_ids),
            response_ids=list(s.completion_ids[:n]),
            response_mask=list(s.loss_mask[:n]),
            response_logprobs=[float(x) for x in logprobs[:n]],
            reward_score=None if not self.settings.use_reward or s.reward is None else float(s.reward),
            num_turns=1 + ep["turns"] + ep["responses"],  # verl's: the prompt, each turn, each answer read
            metrics=AgentLoopMetrics(generate_sequences=seconds),
            extra_fields={
                "loom_policy_version": s.policy_version,
                "loom_policy_namespace": s.policy_namespace,
                "loom_trajectory_id": s.id,
                "loom_group_id": group_id,
                "loom_reward": s.reward,
                "loom_components": dict(s.components),
                "loom_env_mask": list(s.env_mask[:n]),
                "loom_advantages": None if s.advantages is None else list(s.advantages[:n]),
                "loom_truncated": len(s.completion_ids) > n,
                "loom_stop_reason": ep["stop_reason"],
                "loom_tool_calls": ep["tool_calls"],
                "loom_env_steps": ep["env_steps"],
                "turn_scores": [],
                "tool_rewards": [],
            },
        )


# ------------------------------------------------------------------------------------------------
# one Loom job for the rows of one generate_sequences call


_open: dict[tuple[int, str, str], _Job] = {}  # per event loop and config: the job rows still join


class _Job:
    def __init__(self, settings: LoomSettings, sampling_params: Mapping[str, Any], response_length: int):
        self.settings = settings
        self.sampling_params = dict(sampling_params)
        self.response_length = response_length
        self.tasks: dict[str, dict[str, Any]] = {}  # uid -> task, in the order rows came
        self.rows: dict[str, int] = {}
        self.started = False
        self.result: asyncio.Task[dict[str, tuple[list[RolloutSample], str]]] | None = None

    def join(self, uid: str, task: dict[str, Any]) -> int:
        self.tasks.setdefault(uid, task)
        self.rows[uid] = self.rows.get(uid, 0) + 1
        return self.rows[uid] - 1

    async def sample(self, uid: str, slot: int) -> tuple[RolloutSample, str]:
        if self.result is None:
            self.started = True
            self.result = asyncio.ensure_future(self._generate())
        kept = await asyncio.shield(self.result)
        samples, group_id = kept[uid]
        return samples[slot], group_id

    async def _generate(self) -> dict[str, tuple[list[RolloutSample], str]]:
        s = self.settings
        n = max(self.rows.values())
        check_tree_initial(s.mode, s.mode_params, n, "rollout.n")
        version, namespace, match = await self._policy()
        uids = list(self.tasks)
        async with AsyncRollouts(s.url, s.api_key, timeout=s.timeout) as rollouts:
            groups = await rollouts.generate(
                [self.tasks[u] for u in uids],
                mode=s.mode,
                mode_params=follow_window(s.mode, s.mode_params, self.response_length),
                sampling=self._sampling(n),
                reward=s.reward,
                policy_version=version,
                policy_namespace=namespace,
                policy_match=match,
            )
        out: dict[str, tuple[list[RolloutSample], str]] = {}
        for u, g in zip(uids, groups, strict=True):
            rows = trainer_samples(g, s.mode, self.rows[u], exact=False)
            out[u] = rows, rows[0].trajectory.group_id
        return out

    async def _policy(self) -> tuple[int | None, str | None, PolicyMatch | None]:
        s = self.settings
        if s.policy_version is None:
            return None, None, None
        if s.policy_version == LATEST:
            if not s.api_key:
                raise ValueError("policy_version 'latest' reads the key's versions: it needs an api_key")
            key = s.api_key

            def newest() -> tuple[int, str | None]:
                publisher = PolicyPublisher(s.url, key)
                try:
                    refs = publisher.versions()
                finally:
                    publisher.close()
                return (refs[-1].version, refs[-1].namespace) if refs else (0, s.policy_namespace)

            version, namespace = await asyncio.to_thread(newest)
            return version, namespace, s.policy_match or "exact"
        return int(s.policy_version), s.policy_namespace, s.policy_match

    def _sampling(self, n: int) -> dict[str, Any]:
        p = self.sampling_params
        follows: dict[str, Any] = {"n": n, "max_tokens": self.response_length}
        if p.get("temperature") is not None:
            follows["temperature"] = float(p["temperature"])
        if p.get("top_p") is not None:
            follows["top_p"] = float(p["top_p"])
        if p.get("top_k") is not None:
            follows["top_k"] = int(p["top_k"]) if int(p["top_k"]) > 0 else -1
        return follows | self.settings.sampling


@register("loom_tool_agent")
class LoomToolAgentLoop(LoomAgentLoop):
    """verl's tool agent loop (``tool_agent``, verl/experimental/agent_loop/tool_agent_loop.py) with
    every episode from Loom's agent mode (docs/interop-rollout.md, "Agent mode at each trainer's
    seam"): the same config keys as ``LoomAgentLoop``, mode ``agent``, and what verl's own
    ``rollout.multi_turn`` says where ``mode_params`` leave it unset: ``max_assistant_turns`` is
    ``max_turns``, ``format`` the parser (where it is one of Loom's), and the tools verl loaded
    (``tool_config_path`` / ``function_tool_path``) Loom's ``tools`` where each is a built-in of that
    name (Loom runs its own; any other is refused). Each row's ``response_mask`` is 0 on the tool
    responses, as verl's own loop masks them, and ``num_turns`` counts the prompt, each policy turn
    and each tool response, as verl's does."""

    def __init__(
        self, *args: Any, mode: Mode = "agent", mode_params: Mapping[str, Any] | None = None, **kwargs: Any
    ):
        if mode != "agent":
            raise ValueError(f"LoomToolAgentLoop runs Loom's agent mode, not {mode!r}")
        params = dict(plain(mode_params) or {})
        config = kwargs.get("trainer_config")
        multi_turn = _multi_turn(config)
        turns = multi_turn.get("max_assistant_turns")
        if turns is not None:
            params.setdefault("max_turns", int(turns))
        if multi_turn.get("format") in ("hermes", "function"):
            params.setdefault("parser", multi_turn["format"])
        wrap = kwargs.get("tools")
        verl_tools = list(getattr(wrap, "tools", None) or [])
        if verl_tools:
            params.setdefault("tools", loom_tools(verl_tools, "verl"))
        super().__init__(*args, mode="agent", mode_params=params, **kwargs)


def _multi_turn(config: Any) -> dict[str, Any]:
    """What Loom reads of verl's ``actor_rollout_ref.rollout.multi_turn`` (verl's ``MultiTurnConfig``),
    from the trainer config verl passes (wrapped in ``DictConfigWrap``)."""
    cfg = getattr(config, "config", config)
    try:
        found = cfg.actor_rollout_ref.rollout.multi_turn
    except AttributeError:
        return {}
    return {k: plain(found.get(k)) for k in ("max_assistant_turns", "format")}
